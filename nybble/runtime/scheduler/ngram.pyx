# cython: language_level=3
"""Python face of the n-gram proposer (see ngram.pxd); the scheduler calls the C function."""
from libc.stdint cimport int32_t

import numpy as np

from nybble.runtime.scheduler.ngram cimport ngram_propose


def propose_ngram(token_ids, int min_n, int max_n, int k):
    """Prompt-lookup proposal for a sequence ``token_ids`` (1-D ints): int32[m], m <= k.

    Raises:
        ValueError: ``min_n`` < 1, ``max_n`` < ``min_n`` or ``k`` < 0.
    """
    if min_n < 1 or max_n < min_n or k < 0:
        raise ValueError(f"need 1 <= min_n <= max_n and k >= 0, got min_n={min_n}, "
                         f"max_n={max_n}, k={k}")
    cdef int32_t[::1] toks = np.ascontiguousarray(token_ids, dtype=np.int32)
    out = np.zeros(max(k, 1), np.int32)
    cdef int32_t[::1] o = out
    if toks.shape[0] == 0:
        return out[:0]
    cdef int32_t m = ngram_propose(&toks[0], <int32_t> toks.shape[0], min_n, max_n, k, &o[0])
    return out[:m]
