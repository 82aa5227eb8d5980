# Array checks shared by the CPU kernels' Cython wrappers (Cython `include`, once per .pyx,
# before qgemm_struct.pxi / wo_struct.pxi): `_qarr` returns the data pointer of a C-contiguous
# numpy array of the given dtype and shape, or raises a ValueError naming it.
from libc.stdint cimport int8_t, int64_t, uint8_t
cimport numpy as cnp
import numpy as np


cdef const void *_qarr(object a, object dtype, tuple shape, str name) except? NULL:
    if (not isinstance(a, np.ndarray) or a.dtype != dtype or not a.flags.c_contiguous
            or a.shape != shape):
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype).name} array of shape "
                         f"{shape}, got {type(a).__name__} {getattr(a, 'dtype', None)} "
                         f"{getattr(a, 'shape', None)}")
    return cnp.PyArray_DATA(<cnp.ndarray> a)
