"""Build the Cython host runtime (prefix cache, block allocator, sequence table, scheduler)
and the CPU decode-attention kernel.

Metadata lives in pyproject.toml; this file only declares the extension modules.
Set ``NYBBLE_CYTHON_DEBUG=1`` to turn bounds checks back on and add line tracing. This file
owns the Cython directives: the ``.pyx`` / ``.pxd`` headers set only ``language_level`` (a
file's header would beat ``compiler_directives``); tests/test_cython_build.py checks both.
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("NYBBLE_CYTHON_DEBUG", "0") == "1"
directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "cdivision": True,
    "initializedcheck": DEBUG,
}
if DEBUG:
    directives["linetrace"] = True
macros = [("CYTHON_TRACE_NOGIL", "1")] if DEBUG else []
macros.append(("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"))

# The Cython scheduling core (nybble/runtime/scheduler/*.pyx).
extensions = [
    Extension(
        f"nybble.runtime.scheduler.{name}",
        [f"nybble/runtime/scheduler/{name}.pyx"],
        include_dirs=[np.get_include()],
        define_macros=macros,
        extra_compile_args=["-O3"],
    )
    for name in ("sequence", "prefix_cache", "block_allocator", "batch_builder", "seq_table",
                 "scheduler", "ngram")
]
CPU = "nybble/kernels/cpu"
# NOTE: the C headers' folder is on the include path: no header there may share a system
# header's name (hence cpu_features.h, not features.h, which glibc has).
# The CPU paged decode attention kernel (nybble/kernels/cpu/attention.pyx).
# NOTE: -fassociative-math (with the flags it needs) lets GCC vectorise the dot products'
# sums; no -ffast-math: infinities (the softmax's -inf start) and NaN checks stay IEEE.
extensions.append(Extension(
    "nybble.kernels.cpu.attention", [f"{CPU}/attention.pyx"], define_macros=macros,
    extra_compile_args=["-O3", "-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math",
                        "-fassociative-math"]))
# The CPU weight-only INT4/INT8 GEMM (nybble/kernels/cpu/wo_gemm.pyx + .h): the AVX2 path is
# compiled for that target alone (function attributes) and chosen at run time, so the module
# still loads on CPUs without it.
extensions.append(Extension(
    "nybble.kernels.cpu.wo_gemm", [f"{CPU}/wo_gemm.pyx"], define_macros=macros,
    include_dirs=[CPU, np.get_include()],
    depends=[f"{CPU}/wo_gemm.h", f"{CPU}/wo_struct.pxi", f"{CPU}/cpu_arrays.pxi",
             f"{CPU}/cpu_features.h", f"{CPU}/pool.h", f"{CPU}/pool.pxi"],
    extra_compile_args=["-O3"]))
# The CPU quantized GEMM with bf16 or VNNI integer dot products (nybble/kernels/cpu/qgemm.pyx,
# qgemm.h, idot.h): the AVX-512 BF16 / VNNI paths are compiled for those targets alone
# (function attributes) and chosen at run time; no -ffast-math (the bf16 rounding and the
# sums' order are part of the contract).
extensions.append(Extension(
    "nybble.kernels.cpu.qgemm", ["nybble/kernels/cpu/qgemm.pyx"], define_macros=macros,
    include_dirs=["nybble/kernels/cpu", np.get_include()],
    depends=["nybble/kernels/cpu/qgemm.h", "nybble/kernels/cpu/idot.h",
             "nybble/kernels/cpu/qdequant.h",
             "nybble/kernels/cpu/qgemm_struct.pxi", "nybble/kernels/cpu/cpu_arrays.pxi",
             "nybble/kernels/cpu/cpu_features.h", "nybble/kernels/cpu/pool.h",
             "nybble/kernels/cpu/pool.pxi"],
    extra_compile_args=["-O3"]))
# The fused CPU decode step (nybble/kernels/cpu/decoder.pyx + .h, which includes qgemm.h for
# packed projections); the same float flags as the attention kernel, so the dense dot products'
# sums vectorise (the packed path's AVX-512 BF16 code is intrinsics, unaffected).
extensions.append(Extension(
    "nybble.kernels.cpu.decoder", [f"{CPU}/decoder.pyx"], define_macros=macros,
    include_dirs=[CPU, np.get_include()],
    depends=[f"{CPU}/decoder.h", f"{CPU}/qgemm.h", f"{CPU}/idot.h", f"{CPU}/qgemm_struct.pxi",
             f"{CPU}/wo_gemm.h", f"{CPU}/wo_struct.pxi", f"{CPU}/cpu_arrays.pxi",
             f"{CPU}/cpu_features.h", f"{CPU}/pool.h", f"{CPU}/pool.pxi"],
    extra_compile_args=["-O3", "-fno-math-errno", "-fno-signed-zeros", "-fno-trapping-math",
                        "-fassociative-math"]))

# NOTE: a separate build dir per mode, so toggling NYBBLE_CYTHON_DEBUG never reuses stale C.
setup(ext_modules=cythonize(extensions, compiler_directives=directives,
                            build_dir="build/cython-debug" if DEBUG else None))
