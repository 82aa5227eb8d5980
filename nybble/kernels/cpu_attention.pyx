# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Paged decode attention on the CPU, straight from the block tables (no gathered copy).

One new token per sequence. For each sequence the kernel walks its ``seq_lens[b]`` cached
positions through its block table (PagedAttention, Kwon et al., SOSP 2023) and scores every
query head against the key of its KV head (GQA: ``h // (Hq / Hkv)``); a position's keys of all
heads are contiguous, so each is read once. Then a softmax per head in two passes (max, then
``exp(s - max)`` and their sum) and, again position by position, the probability-weighted sum
of the values. Every loop
stops at the sequence's own length: no padding to the longest sequence of the batch and no
``[B, S, Hkv, D]`` copy of the cache, which is what the torch path pays every layer.

float32 in, float32 accumulation; the GIL is released. Torch-free: callers pass numpy views
(``tensor.numpy()`` of CPU tensors). Shapes follow :mod:`nybble.kernels.interface`.
"""
from libc.math cimport expf, INFINITY
from libc.stdint cimport int32_t


def paged_decode_attention(const float[:, :, :] query,
                           const float[:, :, :, :, ::1] kv_cache,
                           const int32_t[:, ::1] block_tables,
                           const int32_t[::1] seq_lens,
                           float scale,
                           float[:, :, ::1] out,
                           float[::1] scratch):
    """``out[b] = softmax(query[b] k^T * scale) v`` over sequence ``b``'s cached keys/values.

    Args:
        query: ``[B, Hq, D]`` float32, any strides with a contiguous last dimension (row
            ``b`` is sequence ``b``'s token).
        kv_cache: ``[2, NB, BS, Hkv, D]`` float32, C-contiguous, holding this step's K/V.
        block_tables: ``[B, MB]`` int32 block ids (entries past a sequence's blocks unread).
        seq_lens: ``[B]`` int32 cached tokens of each sequence, ``1 <= seq_lens[b] <=
            MB * BS``.
        scale: softmax scale.
        out: ``[B, Hq, D]`` float32, C-contiguous, written fully.
        scratch: float32 work space of at least ``Hq * (max(seq_lens) + D + 1)`` values.

    Raises:
        ValueError: shapes that do not fit together, or a ``scratch`` too small.
    """
    cdef Py_ssize_t batch = query.shape[0], num_heads = query.shape[1]
    cdef Py_ssize_t head_dim = query.shape[2]
    cdef Py_ssize_t block_size = kv_cache.shape[2], num_kv_heads = kv_cache.shape[3]
    cdef Py_ssize_t width = block_tables.shape[1]
    if kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim or num_kv_heads == 0 \
            or num_heads % num_kv_heads != 0:
        raise ValueError(f"kv_cache must be [2, NB, BS, Hkv, D={head_dim}] with Hq % Hkv == 0, "
                         f"got {[kv_cache.shape[i] for i in range(5)]} for Hq={num_heads}")
    if block_tables.shape[0] < batch or seq_lens.shape[0] < batch:
        raise ValueError(f"block_tables and seq_lens need {batch} rows, got "
                         f"{block_tables.shape[0]} and {seq_lens.shape[0]}")
    if query.strides[2] != sizeof(float):
        raise ValueError(f"query's last dimension must be contiguous, got strides "
                         f"{[query.strides[i] for i in range(3)]}")
    if out.shape[0] != batch or out.shape[1] != num_heads or out.shape[2] != head_dim:
        raise ValueError(f"out must be [{batch}, {num_heads}, {head_dim}], got "
                         f"{[out.shape[i] for i in range(3)]}")
    cdef Py_ssize_t group = num_heads // num_kv_heads
    cdef Py_ssize_t b, longest = 0
    for b in range(batch):
        if seq_lens[b] < 1 or seq_lens[b] > width * block_size:
            raise ValueError(f"seq_lens[{b}] must be in [1, {width * block_size}], "
                             f"got {seq_lens[b]}")
        longest = max(longest, seq_lens[b])
    if scratch.shape[0] < num_heads * (longest + head_dim + 1):
        raise ValueError(f"scratch must hold {num_heads * (longest + head_dim + 1)} floats, "
                         f"got {scratch.shape[0]}")
    if batch == 0:
        return
    cdef float* work = &scratch[0]
    cdef const float* keys = &kv_cache[0, 0, 0, 0, 0]
    cdef const float* values = &kv_cache[1, 0, 0, 0, 0]
    cdef const float* queries = &query[0, 0, 0]
    cdef Py_ssize_t q_seq = query.strides[0] // sizeof(float)
    cdef Py_ssize_t q_head = query.strides[1] // sizeof(float)
    cdef const int32_t* table
    with nogil:
        for b in range(batch):
            table = &block_tables[b, 0]
            # NOTE: constant head dims let the compiler specialise (unroll, vectorise) the
            # inner loops of its copy of _one_sequence.
            if head_dim == 8:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, seq_lens[b],
                              block_size, num_heads, num_kv_heads, 8, scale, &out[b, 0, 0],
                              work)
            elif head_dim == 64:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, seq_lens[b],
                              block_size, num_heads, num_kv_heads, 64, scale, &out[b, 0, 0],
                              work)
            elif head_dim == 128:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, seq_lens[b],
                              block_size, num_heads, num_kv_heads, 128, scale, &out[b, 0, 0],
                              work)
            else:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, seq_lens[b],
                              block_size, num_heads, num_kv_heads, head_dim, scale,
                              &out[b, 0, 0], work)


cdef inline void _one_sequence(const float* query, Py_ssize_t q_head, const float* keys,
                               const float* values, const int32_t* table, Py_ssize_t length,
                               Py_ssize_t block_size, Py_ssize_t num_heads,
                               Py_ssize_t num_kv_heads, Py_ssize_t head_dim, float scale,
                               float* out, float* work) noexcept nogil:
    """One sequence: ``out [Hq, D]`` (C-contiguous) from ``query`` (head ``h`` at
    ``query + h * q_head``) over its ``length`` cached positions; ``work`` holds
    ``Hq * (length + D + 1)`` floats."""
    cdef Py_ssize_t group = num_heads // num_kv_heads
    cdef Py_ssize_t slot_stride = num_kv_heads * head_dim     # floats between two positions
    cdef Py_ssize_t block_stride = block_size * slot_stride
    cdef float* scores = work                                 # [Hq, L]
    cdef float* acc = work + num_heads * length               # [Hq, D]
    cdef float* denom = acc + num_heads * head_dim            # [Hq]
    cdef Py_ssize_t h, t, d, j, i, n, offset
    cdef const float* q
    cdef const float* k
    cdef const float* v
    cdef float* row
    cdef float* a
    cdef float s, mx, total, p
    # pass 1: every query head against every key; a position's [Hkv, D] keys are contiguous,
    # so each is read once
    t = 0
    for j in range((length + block_size - 1) // block_size):
        offset = table[j] * block_stride
        n = min(block_size, length - t)
        for i in range(n):
            k = keys + offset + i * slot_stride
            for h in range(num_heads):
                q = query + h * q_head
                v = k + (h // group) * head_dim
                s = 0.0
                for d in range(head_dim):
                    s = s + q[d] * v[d]
                scores[h * length + t + i] = s * scale
        t = t + n
    # pass 2: softmax numerators and their sums, per query head
    for h in range(num_heads):
        row = scores + h * length
        mx = -INFINITY
        for t in range(length):
            if row[t] > mx:
                mx = row[t]
        total = 0.0
        for t in range(length):
            p = expf(row[t] - mx)
            row[t] = p
            total = total + p
        denom[h] = total
        for d in range(head_dim):
            acc[h * head_dim + d] = 0.0
    # pass 3: probability-weighted values, position by position
    t = 0
    for j in range((length + block_size - 1) // block_size):
        offset = table[j] * block_stride
        n = min(block_size, length - t)
        for i in range(n):
            v = values + offset + i * slot_stride
            for h in range(num_heads):
                p = scores[h * length + t + i]
                a = acc + h * head_dim
                k = v + (h // group) * head_dim
                for d in range(head_dim):
                    a[d] = a[d] + p * k[d]
        t = t + n
    for h in range(num_heads):
        for d in range(head_dim):
            out[h * head_dim + d] = acc[h * head_dim + d] / denom[h]
