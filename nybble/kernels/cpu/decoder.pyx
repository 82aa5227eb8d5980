# cython: language_level=3
"""A Llama-family decoder's whole decode step on the CPU in one call (the C code and its
layouts: ``decoder.h``).

Built once per model and KV-cache pool from numpy views of the weights and caches
(``tensor.numpy()`` shares memory, so later writes to the cache are seen): float32 arrays, or
for a quantized model packed weights of either CPU kernel, bf16-dot
(:class:`nybble.kernels.cpu.qgemm_pack.QPacked`, ``qgemm.h``) or float32 weight-only
(:class:`nybble.kernels.cpu.weight_only.CpuWeight`, ``wo_gemm.h``). Each step then takes the token ids, positions, slot mapping, block
tables and sequence lengths and writes the final hidden states. Torch-free. The GIL is
released while the step runs.
"""
from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc

include "cpu_arrays.pxi"
include "qgemm_struct.pxi"
include "pool.pxi"
include "wo_struct.pxi"

cnp.import_array()


cdef extern from "decoder.h" nogil:
    enum: NYB_MAX_PARTS
    ctypedef struct nyb_proj:
        const float *w
        const float *b
        int nparts
        const nyb_qw *parts[NYB_MAX_PARTS]
        const nyb_wo_weight *wo[NYB_MAX_PARTS]
    ctypedef struct nyb_lora:
        const float *a
        const float *bt
        int64_t R
    ctypedef struct nyb_layer:
        const float *in_norm
        const float *post_norm
        nyb_proj qkv
        nyb_proj o
        nyb_proj gu
        nyb_proj down
        void *kv_cache
        nyb_lora lqkv
        nyb_lora lo
        nyb_lora lgu
        nyb_lora ldown
    ctypedef struct nyb_decoder:
        int64_t H, FF, Hq, Hkv, D, L, V, NB, BS, P
        float eps, scale
        const float *embed
        const nyb_qw *embed_q
        const nyb_wo_weight *embed_wo
        const float *final_norm
        const float *cos_sin
        const nyb_layer *layers
        int64_t LS, LR
        int kv_bf16
    int nyb_decode_forward(const nyb_decoder *M, int64_t T, const int64_t *ids,
                           const int64_t *pos, const int64_t *slots, const int32_t *tables,
                           int64_t MB, const int32_t *seq_lens, const int64_t *lslots,
                           float *out, int portable)
    void nyb_dense_linear(const float *x, int64_t T, int64_t K, const float *W, int64_t N,
                          float *y, int portable)
    int nyb_decoder_avx2()

LAYER_FIELDS = ("in_norm", "qkv_w", "qkv_b", "o_w", "o_b", "post_norm", "gu_w", "gu_b",
                "down_w", "down_b", "kv_cache")
"""The per-layer arrays :class:`CpuDecoder` takes, in order (biases may be None; a ``*_w`` is a
float32 array or a list of packed parts)."""
MAX_PARTS = NYB_MAX_PARTS
"""Most packed parts one projection may have (their output features concatenated)."""


def dense_linear(const float[:, ::1] x, const float[:, ::1] w, float[:, ::1] out,
                 bint portable=False) -> None:
    """``out [T, N] = x [T, K] @ w [N, K]^T`` in float32 with the fused step's projection loop
    (one row: row by row, the next row prefetched; a few rows: weight rows in pairs, the pairs
    ahead prefetched; a GEMV that streams ``w`` at memory speed, where a BLAS call on one row
    reached about half of it; used for a float32 LM head of a few rows).

    Raises:
        ValueError: shapes that do not match.
    """
    cdef int64_t t = x.shape[0], k = x.shape[1], n = w.shape[0]
    if w.shape[1] != k or out.shape[0] != t or out.shape[1] != n or t < 1:
        raise ValueError(f"dense_linear needs x [T, K], w [N, K] and out [T, N], got "
                         f"({x.shape[0]}, {x.shape[1]}), ({w.shape[0]}, {w.shape[1]}), "
                         f"({out.shape[0]}, {out.shape[1]})")
    with nogil:
        nyb_dense_linear(&x[0, 0], t, k, &w[0, 0], n, &out[0, 0], portable)


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


cdef void *_kv_ptr(object a, tuple shape, str name, bint bf16) except NULL:
    """The data of a C-contiguous KV cache of ``shape``: float32, or (``bf16``) its bfloat16
    bits as uint16."""
    want = np.uint16 if bf16 else np.float32
    if (not isinstance(a, np.ndarray) or a.dtype != want or not a.flags.c_contiguous
            or a.shape != shape):
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(want).name} numpy array of "
                         f"shape {shape} (every layer's cache of one dtype), got "
                         f"{type(a).__name__} {getattr(a, 'dtype', None)} "
                         f"{getattr(a, 'shape', None)}")
    return cnp.PyArray_DATA(<cnp.ndarray> a)


def _is_wo(p) -> bool:
    """A weight-only packed weight (``CpuWeight``: it has zeros), not a bf16-dot one."""
    return hasattr(p, "zeros")


def _features(w) -> tuple[int, int]:
    """``(out, in)`` features of a projection given as a float32 array or packed parts."""
    if isinstance(w, np.ndarray):
        return w.shape[0], w.shape[1]
    return sum(p.out_features for p in w), w[0].in_features


cdef class CpuDecoder:
    """The decode step of one model over one KV-cache pool.

    Args:
        embed: ``[V, H]`` float32, or a ``QPacked`` / ``CpuWeight`` of ``V`` output features
            and ``H`` inputs (rows dequantized as they are looked up).
        final_norm: ``[H]``. cos_sin: ``[P, 2, D]`` RoPE table.
        layers: per layer, the arrays of :data:`LAYER_FIELDS`: norms ``[H]``, ``qkv_w
            [(Hq + 2 Hkv) D, H]``, ``o_w [H, Hq D]``, ``gu_w [2 I, H]``, ``down_w [H, I]``,
            biases ``[out]`` or None, ``kv_cache [2, NB, BS, Hkv, D]``; float32,
            C-contiguous (the caches may instead all be uint16: bfloat16 bits, written rounded
            to nearest even and read widened). Each ``*_w`` may instead be a list of 1 to
            :data:`MAX_PARTS` packed weights of one kind (all ``QPacked`` or all
            ``CpuWeight``) of the same inputs whose outputs, concatenated, are the
            projection's.
        num_heads, num_kv_heads: ``Hq``, ``Hkv`` (``Hq % Hkv == 0``). eps: RMSNorm epsilon.
        scale: the attention's softmax scale.
        lora: multi-LoRA slots, or None: per layer, for qkv, o, gate/up and down in that order,
            ``(a [S, R, in], bt [S, R, out])`` float32 C-contiguous (``bt``: the slots' ``B``
            transposed, each adapter's scale folded in; ``R`` may differ per projection, ``S``
            may not); :meth:`forward`'s ``lora_slots`` then picks each row's slot.

    Raises:
        ValueError: an array of the wrong dtype, shape or layout, packed parts that do not
            add up to the projection, or heads that do not divide.
    """

    cdef nyb_decoder model
    cdef nyb_layer *layers
    cdef nyb_qw *packed
    cdef nyb_wo_weight *wo
    cdef int npacked, nwo
    cdef list keep

    def __cinit__(self):
        self.layers = NULL
        self.packed = NULL
        self.wo = NULL
        self.npacked = self.nwo = 0

    cdef int _proj(self, nyb_proj *P, object w, object b, int64_t n, int64_t k,
                   str name) except -1:
        """Point ``P`` at ``w`` (float32 ``[n, k]`` or packed parts) and ``b`` (``[n]``)."""
        P.b = _ptr(b, (n,), f"{name} bias")
        P.nparts = 0
        P.w = NULL
        if isinstance(w, np.ndarray):
            P.w = _ptr(w, (n, k), name)
            return 0
        parts = list(w)
        if not 1 <= len(parts) <= NYB_MAX_PARTS:
            raise ValueError(f"{name} must be a float32 array or 1 to {NYB_MAX_PARTS} packed "
                             f"parts, got {len(parts)}")
        if any(p.in_features != k for p in parts) or sum(p.out_features for p in parts) != n:
            raise ValueError(f"{name}'s packed parts must take {k} inputs and give {n} outputs "
                             f"together, got {[(p.out_features, p.in_features) for p in parts]}")
        wo = [_is_wo(p) for p in parts]
        if any(wo) and not all(wo):
            raise ValueError(f"{name}'s packed parts must all be of one kernel's layout")
        cdef int i
        for i in range(NYB_MAX_PARTS):
            P.parts[i], P.wo[i] = NULL, NULL
        for i in range(len(parts)):
            if wo[i]:
                _fill_wo(self.wo + self.nwo, parts[i])
                P.wo[i] = self.wo + self.nwo
                self.nwo += 1
            else:
                _fill_qw(self.packed + self.npacked, parts[i])
                P.parts[i] = self.packed + self.npacked
                self.npacked += 1
        P.nparts = len(parts)
        return 0

    cdef int _lora(self, nyb_lora *L, object pair, int64_t k, int64_t n, str name) except -1:
        """Point ``L`` at a projection's LoRA slots ``(a [S, R, k], bt [S, R, n])``."""
        a, bt = pair
        if not isinstance(a, np.ndarray) or a.ndim != 3:
            raise ValueError(f"{name} LoRA a must be a [S, R, {k}] float32 array")
        s, r = a.shape[0], a.shape[1]
        if self.model.LS and s != self.model.LS:
            raise ValueError(f"{name} LoRA has {s} slots, another projection {self.model.LS}")
        L.a = _ptr(a, (s, r, k), f"{name} LoRA a")
        L.bt = _ptr(bt, (s, r, n), f"{name} LoRA bt")
        L.R = r
        self.model.LS = s
        self.model.LR = max(self.model.LR, r)
        return 0

    def __init__(self, embed, final_norm, cos_sin, list layers, int num_heads,
                 int num_kv_heads, float eps, float scale, list lora=None):
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if not layers:
            raise ValueError("a decoder needs at least one layer, got 0")
        v, h = (embed.shape if isinstance(embed, np.ndarray) else
                (embed.out_features, embed.in_features))
        p, _, d = cos_sin.shape
        inter = _features(layers[0][8])[1]
        cache = layers[0][10]
        m = &self.model
        m.H, m.FF, m.Hq, m.Hkv, m.D, m.L = h, inter, num_heads, num_kv_heads, d, len(layers)
        m.V, m.NB, m.BS, m.P = v, cache.shape[1], cache.shape[2], p
        m.eps, m.scale = eps, scale
        m.LS, m.LR = 0, 0
        m.kv_bf16 = isinstance(cache, np.ndarray) and cache.dtype == np.uint16
        if lora is not None and len(lora) != len(layers):
            raise ValueError(f"lora must give one entry per layer ({len(layers)}), got "
                             f"{len(lora)}")
        # every packed weight's nyb_qw: the embedding's and up to 4 per projection
        cdef size_t most = 1 + 4 * NYB_MAX_PARTS * len(layers)
        self.packed = <nyb_qw *> malloc(sizeof(nyb_qw) * most)
        self.wo = <nyb_wo_weight *> malloc(sizeof(nyb_wo_weight) * most)
        if self.packed == NULL or self.wo == NULL:
            raise MemoryError("no memory for the decoder's packed-weight table")
        m.embed, m.embed_q, m.embed_wo = NULL, NULL, NULL
        if isinstance(embed, np.ndarray):
            m.embed = _ptr(embed, (v, h), "embed")
        elif _is_wo(embed):
            _fill_wo(self.wo, embed)
            m.embed_wo = self.wo
            self.nwo = 1
        else:
            _fill_qw(self.packed, embed)
            m.embed_q = self.packed
            self.npacked = 1
        m.final_norm = _ptr(final_norm, (h,), "final_norm")
        m.cos_sin = _ptr(cos_sin, (p, 2, d), "cos_sin")
        self.keep = [embed, final_norm, cos_sin, layers, lora]
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
            self._proj(&ly.qkv, a["qkv_w"], a["qkv_b"], qkv, h, f"layer {i} qkv_w")
            self._proj(&ly.o, a["o_w"], a["o_b"], h, num_heads * d, f"layer {i} o_w")
            self._proj(&ly.gu, a["gu_w"], a["gu_b"], 2 * inter, h, f"layer {i} gu_w")
            self._proj(&ly.down, a["down_w"], a["down_b"], h, inter, f"layer {i} down_w")
            ly.kv_cache = _kv_ptr(a["kv_cache"], (2, m.NB, m.BS, num_kv_heads, d),
                                  f"layer {i} kv_cache", m.kv_bf16)
            ly.lqkv.a = ly.lo.a = ly.lgu.a = ly.ldown.a = NULL
            if lora is not None:
                pairs = lora[i]
                self._lora(&ly.lqkv, pairs[0], h, qkv, f"layer {i} qkv")
                self._lora(&ly.lo, pairs[1], num_heads * d, h, f"layer {i} o")
                self._lora(&ly.lgu, pairs[2], h, 2 * inter, f"layer {i} gate_up")
                self._lora(&ly.ldown, pairs[3], inter, h, f"layer {i} down")
        m.layers = self.layers

    def __dealloc__(self):
        free(self.layers)
        free(self.packed)
        free(self.wo)

    def forward(self, const int64_t[::1] input_ids, const int64_t[::1] positions,
                const int64_t[::1] slot_mapping, const int32_t[:, ::1] block_tables,
                const int32_t[::1] seq_lens, float[:, ::1] out, bint portable=False,
                lora_slots=None):
        """One decode step: ``T`` sequences, one new token each; writes their K/V into the
        caches and ``out [T, H]`` (the final hidden states, after the last norm).

        Args:
            input_ids, positions, slot_mapping: ``[T]`` int64 (slot ``-1``: no KV write).
            block_tables: ``[T, MB]`` int32. seq_lens: ``[T]`` int32 cached tokens after
                this step. out: ``[T, H]`` float32. portable: the portable C even where
                AVX2 exists (tests).
            lora_slots: ``[T]`` int64 LoRA slot of each row (``-1``: base), or None (no row
                uses an adapter); needs a decoder built with ``lora``.

        Raises:
            ValueError: arrays of different lengths, or an index out of range (token id,
                position, slot, sequence length, block id); nothing is written then.
            MemoryError: no memory for the step's scratch space (the KV cache may hold some
                of the step's writes then).
        """
        cdef int64_t t = input_ids.shape[0]
        if t < 1 or positions.shape[0] != t or slot_mapping.shape[0] != t \
                or block_tables.shape[0] != t or seq_lens.shape[0] != t \
                or out.shape[0] != t or out.shape[1] != self.model.H:
            raise ValueError(f"a step of {t} tokens needs positions, slot_mapping, seq_lens "
                             f"[{t}], block_tables [{t}, MB] and out [{t}, {self.model.H}]")
        cdef const int64_t[::1] lslots
        cdef const int64_t *lptr = NULL
        if lora_slots is not None:
            if self.model.LS == 0:
                raise ValueError("lora_slots needs a decoder built with lora")
            lslots = lora_slots
            if lslots.shape[0] != t:
                raise ValueError(f"lora_slots must be [{t}], got [{lslots.shape[0]}]")
            lptr = &lslots[0]
        cdef int rc
        with nogil:
            rc = nyb_decode_forward(&self.model, t, &input_ids[0], &positions[0],
                                    &slot_mapping[0], &block_tables[0, 0],
                                    block_tables.shape[1], &seq_lens[0], lptr, &out[0, 0],
                                    portable)
        if rc == -2:
            raise ValueError(f"an index is out of range: token ids must be in [0, "
                             f"{self.model.V}), positions in [0, {self.model.P}), slots in "
                             f"[-1, {self.model.NB * self.model.BS}), seq_lens in [1, "
                             f"{block_tables.shape[1] * self.model.BS}], block ids in [0, "
                             f"{self.model.NB}), LoRA slots in [-1, {self.model.LS})")
        if rc != 0:
            raise MemoryError("cpu_decoder: no memory for the step's scratch space")
