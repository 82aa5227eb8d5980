# cython: language_level=3
"""N-gram (prompt lookup) proposals for speculative decoding, over a sequence's own tokens.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method): take the last ``n`` tokens of
the sequence, for ``n`` from ``max_n`` down to ``min_n``; find the most recent earlier place
where those ``n`` tokens occur, and propose the (up to ``k``) tokens that followed them there.
The first ``n`` with a match wins. Compiled into the scheduler (``cimport``); ngram.pyx gives
it a Python face for the tests.
"""
from libc.stdint cimport int32_t


cdef inline int32_t ngram_propose(const int32_t* tokens, int32_t num_tokens, int32_t min_n,
                                  int32_t max_n, int32_t k, int32_t* out) noexcept nogil:
    """Write up to ``k`` proposed tokens to ``out`` (which may alias ``tokens + num_tokens``);
    return how many (0: no n-gram of ``min_n..max_n`` tokens recurs)."""
    cdef int32_t n, i, j, m, start
    if k <= 0:
        return 0
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        start = num_tokens - n              # the suffix is tokens[start:num_tokens]
        i = start - 1                       # candidate match tokens[i:i+n], i + n < num_tokens
        while i >= 0:
            j = 0
            while j < n and tokens[i + j] == tokens[start + j]:
                j += 1
            if j == n:
                m = min(k, num_tokens - (i + n))
                for j in range(m):
                    out[j] = tokens[i + n + j]
                return m
            i -= 1
    return 0
