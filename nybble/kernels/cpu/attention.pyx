# cython: language_level=3
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

A quantized cache (:mod:`nybble.kernels.kv_quant`) comes with the layer's per-head scales: a
key's scale multiplies its dot product once, a value's scale its probability. An ``int8``
cache is read as ``int8`` (the conversion vectorises); an ``fp8_e4m3`` cache as its bytes
(``uint8``) through a 256-entry table of what each byte stands for.

A sliding-window layer passes ``window``: the walk starts at position ``seq_len - window``
(transformers' rule: a query sees the last ``window`` positions, itself included), so its cost
is the window's, not the sequence's. ``softcap`` > 0 caps each scaled score to
``c * tanh(s / c)`` (Gemma 2).

A quantized cache that holds keys before RoPE (:class:`nybble.kernels.kv_quant.RotaryKeys`)
comes with the keys' per-channel zero point and the layer's rotary table: each position's keys
are dequantized, shifted and rotated once (all KV heads), then scored against every query head.
"""
from libc.math cimport expf, tanhf, INFINITY
from libc.stdint cimport int8_t, int32_t, uint8_t

ctypedef fused cache_t:
    float
    int8_t
    uint8_t


def paged_decode_attention(const float[:, :, :] query,
                           const cache_t[:, :, :, :, ::1] kv_cache,
                           const int32_t[:, ::1] block_tables,
                           const int32_t[::1] seq_lens,
                           float scale,
                           float[:, :, ::1] out,
                           float[::1] scratch,
                           const float[:, ::1] kv_scale=None,
                           const float[::1] byte_values=None,
                           Py_ssize_t window=0,
                           float softcap=0.0,
                           const float[:, ::1] key_zero=None,
                           const float[:, :, ::1] cos_sin=None):
    """``out[b] = softmax(query[b] k^T * scale) v`` over sequence ``b``'s cached keys/values.

    Args:
        query: ``[B, Hq, D]`` float32, any strides with a contiguous last dimension (row
            ``b`` is sequence ``b``'s token).
        kv_cache: ``[2, NB, BS, Hkv, D]`` float32, int8 (an int8 cache) or uint8 (the bytes
            of an fp8 cache), C-contiguous, holding this step's K/V.
        block_tables: ``[B, MB]`` int32 block ids (entries past a sequence's blocks unread).
        seq_lens: ``[B]`` int32 cached tokens of each sequence, ``1 <= seq_lens[b] <=
            MB * BS``.
        scale: softmax scale.
        out: ``[B, Hq, D]`` float32, C-contiguous, written fully.
        scratch: float32 work space of at least ``Hq * (max(seq_lens) + D + 1)`` values,
            ``(Hkv + 1) * D`` more with ``cos_sin``.
        kv_scale: ``[2, Hkv]`` float32 per-head scales (keys, values); int8/uint8 caches.
        byte_values: ``[256]`` float32, the value each byte stands for (float8 e4m3
            decoded); uint8 caches only.
        window: a sliding-window layer's window (tokens, ``> 0``), or 0 (every position).
        softcap: ``c`` of the scores' soft-capping ``c * tanh(s / c)``, or 0 (none).
        key_zero: ``[Hkv, D]`` float32, added to each dequantized key (keys cached before
            RoPE; int8/uint8 caches, with ``cos_sin``).
        cos_sin: ``[P, 2, D]`` float32 rotary table, ``P >= max(seq_lens)``: the key at
            position ``j`` is read as ``x * cos_sin[j, 0] + roll(x, D / 2) * cos_sin[j, 1]``
            (:class:`nybble.kernels.kv_quant.RotaryKeys`); None: keys are cached rotated.

    Raises:
        ValueError: shapes that do not fit together, a ``scratch`` too small, an int8 / uint8
            cache without ``kv_scale [2, Hkv]``, or a uint8 one without ``byte_values [256]``,
            ``cos_sin`` / ``key_zero`` on a float cache, one without the other, or shapes
            that do not fit (an odd ``D``, a table shorter than the longest sequence).
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
    cdef Py_ssize_t need = num_heads * (longest + head_dim + 1)
    if (cos_sin is None) != (key_zero is None):
        raise ValueError("cos_sin and key_zero go together (keys cached before RoPE)")
    if cos_sin is not None:
        if cache_t is float:
            raise ValueError("cos_sin / key_zero need a quantized (int8 / fp8) kv_cache")
        if cos_sin.shape[1] != 2 or cos_sin.shape[2] != head_dim or head_dim % 2 != 0 \
                or cos_sin.shape[0] < longest:
            raise ValueError(f"cos_sin must be [P >= {longest}, 2, D={head_dim}] with an even "
                             f"D, got {[cos_sin.shape[i] for i in range(3)]}")
        if key_zero.shape[0] != num_kv_heads or key_zero.shape[1] != head_dim:
            raise ValueError(f"key_zero must be [{num_kv_heads}, {head_dim}], got "
                             f"{[key_zero.shape[i] for i in range(2)]}")
        need = need + (num_kv_heads + 1) * head_dim
    if scratch.shape[0] < need:
        raise ValueError(f"scratch must hold {need} floats, got {scratch.shape[0]}")
    cdef const float* k_scale = NULL
    cdef const float* v_scale = NULL
    cdef const float* lut = NULL
    cdef const float* zero = NULL
    cdef const float* rope = NULL
    if cache_t is not float:
        if kv_scale is None or kv_scale.shape[0] != 2 or kv_scale.shape[1] != num_kv_heads:
            raise ValueError(f"a quantized kv_cache needs kv_scale [2, {num_kv_heads}] float32")
    if cache_t is uint8_t:
        if byte_values is None or byte_values.shape[0] != 256:
            raise ValueError("a uint8 (fp8) kv_cache needs byte_values [256] float32")
    if batch == 0:
        return
    if cache_t is not float:
        k_scale, v_scale = &kv_scale[0, 0], &kv_scale[1, 0]
    if cache_t is uint8_t:
        lut = &byte_values[0]
    if cos_sin is not None:
        zero, rope = &key_zero[0, 0], &cos_sin[0, 0, 0]
    cdef float* work = &scratch[0]
    cdef const cache_t* keys = &kv_cache[0, 0, 0, 0, 0]
    cdef const cache_t* values = &kv_cache[1, 0, 0, 0, 0]
    cdef const float* queries = &query[0, 0, 0]
    cdef Py_ssize_t q_seq = query.strides[0] // sizeof(float)
    cdef Py_ssize_t q_head = query.strides[1] // sizeof(float)
    cdef const int32_t* table
    cdef Py_ssize_t start
    with nogil:
        for b in range(batch):
            table = &block_tables[b, 0]
            start = first(seq_lens[b], window)
            # NOTE: constant head dims let the compiler specialise (unroll, vectorise) the
            # inner loops of its copy of _one_sequence.
            if head_dim == 8:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, start,
                              seq_lens[b], block_size, num_heads, num_kv_heads, 8, scale,
                              &out[b, 0, 0], work, k_scale, v_scale, lut, softcap, zero, rope)
            elif head_dim == 64:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, start,
                              seq_lens[b], block_size, num_heads, num_kv_heads, 64, scale,
                              &out[b, 0, 0], work, k_scale, v_scale, lut, softcap, zero, rope)
            elif head_dim == 128:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, start,
                              seq_lens[b], block_size, num_heads, num_kv_heads, 128, scale,
                              &out[b, 0, 0], work, k_scale, v_scale, lut, softcap, zero, rope)
            else:
                _one_sequence(queries + b * q_seq, q_head, keys, values, table, start,
                              seq_lens[b], block_size, num_heads, num_kv_heads, head_dim, scale,
                              &out[b, 0, 0], work, k_scale, v_scale, lut, softcap, zero, rope)


cdef inline Py_ssize_t first(Py_ssize_t length, Py_ssize_t window) noexcept nogil:
    """The first position a query at ``length - 1`` sees (0 without a window)."""
    return length - window if 0 < window < length else 0


cdef inline float _value(cache_t x, const float* lut) noexcept nogil:
    """A cached element as float: itself, its int8 value, or what its fp8 byte stands for."""
    if cache_t is uint8_t:
        return lut[x]
    else:
        return <float>x


cdef inline void _one_sequence(const float* query, Py_ssize_t q_head, const cache_t* keys,
                               const cache_t* values, const int32_t* table, Py_ssize_t start,
                               Py_ssize_t end,
                               Py_ssize_t block_size, Py_ssize_t num_heads,
                               Py_ssize_t num_kv_heads, Py_ssize_t head_dim, float scale,
                               float* out, float* work, const float* k_scale,
                               const float* v_scale, const float* lut,
                               float softcap, const float* zero,
                               const float* rope) noexcept nogil:
    """One sequence: ``out [Hq, D]`` (C-contiguous) from ``query`` (head ``h`` at
    ``query + h * q_head``) over its cached positions ``[start, end)``; ``work`` holds
    ``Hq * (end - start + D + 1)`` floats (``(Hkv + 1) * D`` more with ``rope``). A byte
    cache is read through ``lut`` and the per-head ``k_scale`` / ``v_scale``; with ``rope``
    (``[P, 2, D]``) and ``zero`` (``[Hkv, D]``) its keys are pre-RoPE, shifted and rotated as
    they are read."""
    cdef Py_ssize_t length = end - start
    cdef Py_ssize_t group = num_heads // num_kv_heads
    cdef Py_ssize_t slot_stride = num_kv_heads * head_dim     # floats between two positions
    cdef Py_ssize_t block_stride = block_size * slot_stride
    cdef float* scores = work                                 # [Hq, L]
    cdef float* acc = work + num_heads * length               # [Hq, D]
    cdef float* denom = acc + num_heads * head_dim            # [Hq]
    cdef float* rotated = denom + num_heads                   # [Hkv, D] (with rope)
    cdef float* shifted = rotated + num_kv_heads * head_dim   # [D] (with rope)
    cdef Py_ssize_t half = head_dim // 2, kh
    cdef const float* cs
    cdef float ks
    cdef Py_ssize_t h, t, d, j, i, n, offset, pos, i0
    cdef const float* q
    cdef const cache_t* k
    cdef const cache_t* v
    cdef float* row
    cdef float* a
    cdef float s, mx, total, p
    # pass 1: every query head against every key; a position's [Hkv, D] keys are contiguous,
    # so each is read once
    t = 0
    pos = start
    while pos < end:
        j = pos // block_size
        i0 = pos - j * block_size
        n = min(block_size - i0, end - pos)
        offset = table[j] * block_stride + i0 * slot_stride
        for i in range(n):
            k = keys + offset + i * slot_stride
            if cache_t is not float and rope != NULL:
                # this position's keys of every KV head: dequantized, shifted, rotated
                cs = rope + (pos + i) * 2 * head_dim
                for kh in range(num_kv_heads):
                    ks = k_scale[kh]
                    for d in range(head_dim):
                        shifted[d] = _value(k[kh * head_dim + d], lut) * ks + \
                            zero[kh * head_dim + d]
                    a = rotated + kh * head_dim
                    for d in range(half):
                        a[d] = shifted[d] * cs[d] + shifted[d + half] * cs[head_dim + d]
                        a[d + half] = shifted[d + half] * cs[d + half] + \
                            shifted[d] * cs[head_dim + d + half]
                for h in range(num_heads):
                    q = query + h * q_head
                    a = rotated + (h // group) * head_dim
                    s = 0.0
                    for d in range(head_dim):
                        s = s + q[d] * a[d]
                    s = s * scale
                    if softcap > 0.0:
                        s = softcap * tanhf(s / softcap)
                    scores[h * length + t + i] = s
                continue
            for h in range(num_heads):
                q = query + h * q_head
                v = k + (h // group) * head_dim
                s = 0.0
                for d in range(head_dim):
                    s = s + q[d] * _value(v[d], lut)
                if cache_t is not float:
                    s = s * k_scale[h // group]
                s = s * scale
                if softcap > 0.0:
                    s = softcap * tanhf(s / softcap)
                scores[h * length + t + i] = s
        t = t + n
        pos = pos + n
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
    pos = start
    while pos < end:
        j = pos // block_size
        i0 = pos - j * block_size
        n = min(block_size - i0, end - pos)
        offset = table[j] * block_stride + i0 * slot_stride
        for i in range(n):
            v = values + offset + i * slot_stride
            for h in range(num_heads):
                p = scores[h * length + t + i]
                if cache_t is not float:
                    p = p * v_scale[h // group]
                a = acc + h * head_dim
                k = v + (h // group) * head_dim
                for d in range(head_dim):
                    a[d] = a[d] + p * _value(k[d], lut)
        t = t + n
        pos = pos + n
    for h in range(num_heads):
        for d in range(head_dim):
            out[h * head_dim + d] = acc[h * head_dim + d] / denom[h]
