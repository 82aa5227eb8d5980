# cython: language_level=3
"""A Llama-family decoder's whole decode step on the CPU in one call (the C code and its
layouts: ``decoder.h``).

Built once per model and KV-cache pool from numpy views of the float32 weights and caches
(``tensor.numpy()`` shares memory, so later writes to the cache are seen); each step then
takes the token ids, positions, slot mapping, block tables and sequence lengths and writes the
final hidden states. Torch-free. The GIL is released while the step runs.
"""
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc

cimport numpy as cnp
import numpy as np

cnp.import_array()


cdef extern from "decoder.h" nogil:
    ctypedef struct nyb_layer:
        const float *in_norm
        const float *post_norm
        const float *qkv_w
        const float *qkv_b
        const float *o_w
        const float *o_b
        const float *gu_w
        const float *gu_b
        const float *down_w
        const float *down_b
        float *kv_cache
    ctypedef struct nyb_decoder:
        int64_t H, FF, Hq, Hkv, D, L, V, NB, BS, P
        float eps, scale
        const float *embed
        const float *final_norm
        const float *cos_sin
        const nyb_layer *layers
    int nyb_decode_forward(const nyb_decoder *M, int64_t T, const int64_t *ids,
                           const int64_t *pos, const int64_t *slots, const int32_t *tables,
                           int64_t MB, const int32_t *seq_lens, float *out, int portable)
    int nyb_decoder_avx2()

LAYER_FIELDS = ("in_norm", "qkv_w", "qkv_b", "o_w", "o_b", "post_norm", "gu_w", "gu_b",
                "down_w", "down_b", "kv_cache")
"""The per-layer arrays :class:`CpuDecoder` takes, in order (biases may be None)."""


def have_avx2() -> bool:
    """True when the CPU runs the AVX2+FMA copy of the step (else the portable C)."""
    return bool(nyb_decoder_avx2())


cdef const float *_ptr(object a, tuple shape, str name) except? NULL:
    """The data of a C-contiguous float32 array of ``shape`` (None -> NULL)."""
    if a is None:
        return NULL
    if (not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous
            or a.shape != shape):
        raise ValueError(f"{name} must be a C-contiguous float32 numpy array of shape {shape}, "
                         f"got {type(a).__name__} {getattr(a, 'dtype', None)} "
                         f"{getattr(a, 'shape', None)}")
    return <const float *> cnp.PyArray_DATA(<cnp.ndarray> a)


cdef class CpuDecoder:
    """The decode step of one model over one KV-cache pool.

    Args:
        embed: ``[V, H]``. final_norm: ``[H]``. cos_sin: ``[P, 2, D]`` RoPE table.
        layers: per layer, the arrays of :data:`LAYER_FIELDS`: norms ``[H]``, ``qkv_w
            [(Hq + 2 Hkv) D, H]``, ``o_w [H, Hq D]``, ``gu_w [2 I, H]``, ``down_w [H, I]``,
            biases ``[out]`` or None, ``kv_cache [2, NB, BS, Hkv, D]``; all float32,
            C-contiguous.
        num_heads, num_kv_heads: ``Hq``, ``Hkv`` (``Hq % Hkv == 0``). eps: RMSNorm epsilon.
        scale: the attention's softmax scale.

    Raises:
        ValueError: an array of the wrong dtype, shape or layout, or heads that do not
            divide.
    """

    cdef nyb_decoder model
    cdef nyb_layer *layers
    cdef list keep

    def __cinit__(self):
        self.layers = NULL

    def __init__(self, embed, final_norm, cos_sin, list layers, int num_heads,
                 int num_kv_heads, float eps, float scale):
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if not layers:
            raise ValueError("a decoder needs at least one layer, got 0")
        v, h = embed.shape
        p, _, d = cos_sin.shape
        inter = layers[0][8].shape[1]
        cache = layers[0][10]
        m = &self.model
        m.H, m.FF, m.Hq, m.Hkv, m.D, m.L = h, inter, num_heads, num_kv_heads, d, len(layers)
        m.V, m.NB, m.BS, m.P = v, cache.shape[1], cache.shape[2], p
        m.eps, m.scale = eps, scale
        m.embed = _ptr(embed, (v, h), "embed")
        m.final_norm = _ptr(final_norm, (h,), "final_norm")
        m.cos_sin = _ptr(cos_sin, (p, 2, d), "cos_sin")
        self.keep = [embed, final_norm, cos_sin, layers]
        self.layers = <nyb_layer *> malloc(sizeof(nyb_layer) * len(layers))
        if self.layers == NULL:
            raise MemoryError("no memory for the decoder's layer table")
        qkv = (num_heads + 2 * num_kv_heads) * d
        cdef nyb_layer *ly
        cdef Py_ssize_t i
        for i in range(len(layers)):
            arrays = layers[i]
            if len(arrays) != len(LAYER_FIELDS):
                raise ValueError(f"layer {i} must give {len(LAYER_FIELDS)} arrays "
                                 f"{LAYER_FIELDS}, got {len(arrays)}")
            a = dict(zip(LAYER_FIELDS, arrays))
            ly = self.layers + i
            ly.in_norm = _ptr(a["in_norm"], (h,), f"layer {i} in_norm")
            ly.post_norm = _ptr(a["post_norm"], (h,), f"layer {i} post_norm")
            ly.qkv_w = _ptr(a["qkv_w"], (qkv, h), f"layer {i} qkv_w")
            ly.qkv_b = _ptr(a["qkv_b"], (qkv,), f"layer {i} qkv_b")
            ly.o_w = _ptr(a["o_w"], (h, num_heads * d), f"layer {i} o_w")
            ly.o_b = _ptr(a["o_b"], (h,), f"layer {i} o_b")
            ly.gu_w = _ptr(a["gu_w"], (2 * inter, h), f"layer {i} gu_w")
            ly.gu_b = _ptr(a["gu_b"], (2 * inter,), f"layer {i} gu_b")
            ly.down_w = _ptr(a["down_w"], (h, inter), f"layer {i} down_w")
            ly.down_b = _ptr(a["down_b"], (h,), f"layer {i} down_b")
            ly.kv_cache = <float *> _ptr(a["kv_cache"], (2, m.NB, m.BS, num_kv_heads, d),
                                         f"layer {i} kv_cache")
        m.layers = self.layers

    def __dealloc__(self):
        free(self.layers)

    def forward(self, const int64_t[::1] input_ids, const int64_t[::1] positions,
                const int64_t[::1] slot_mapping, const int32_t[:, ::1] block_tables,
                const int32_t[::1] seq_lens, float[:, ::1] out, bint portable=False):
        """One decode step: ``T`` sequences, one new token each; writes their K/V into the
        caches and ``out [T, H]`` (the final hidden states, after the last norm).

        Args:
            input_ids, positions, slot_mapping: ``[T]`` int64 (slot ``-1``: no KV write).
            block_tables: ``[T, MB]`` int32. seq_lens: ``[T]`` int32 cached tokens after
                this step. out: ``[T, H]`` float32. portable: the portable C even where
                AVX2 exists (tests).

        Raises:
            ValueError: arrays of different lengths, or an index out of range (token id,
                position, slot, sequence length, block id); nothing is written then.
            MemoryError: no memory for the step's scratch space.
        """
        cdef int64_t t = input_ids.shape[0]
        if t < 1 or positions.shape[0] != t or slot_mapping.shape[0] != t \
                or block_tables.shape[0] != t or seq_lens.shape[0] != t \
                or out.shape[0] != t or out.shape[1] != self.model.H:
            raise ValueError(f"a step of {t} tokens needs positions, slot_mapping, seq_lens "
                             f"[{t}], block_tables [{t}, MB] and out [{t}, {self.model.H}]")
        cdef int rc
        with nogil:
            rc = nyb_decode_forward(&self.model, t, &input_ids[0], &positions[0],
                                    &slot_mapping[0], &block_tables[0, 0],
                                    block_tables.shape[1], &seq_lens[0], &out[0, 0], portable)
        if rc == -2:
            raise ValueError(f"an index is out of range: token ids must be in [0, "
                             f"{self.model.V}), positions in [0, {self.model.P}), slots in "
                             f"[-1, {self.model.NB * self.model.BS}), seq_lens in [1, "
                             f"{block_tables.shape[1] * self.model.BS}], block ids in [0, "
                             f"{self.model.NB})")
        if rc != 0:
            raise MemoryError("cpu_decoder: no memory for the step's scratch space")
