"""The fused CPU step: a forward step of a Llama-family model in one C call
(:mod:`nybble.kernels.cpu.decoder`) instead of ~230 torch ops.

A small model's decode step on the CPU is dominated by per-op framework overhead (a few
microseconds per op for math that takes less): the bundled model's forward is ~1.1 ms of
dispatch for ~20 MFLOP. The fused step runs the same arithmetic (float32, the model's own RoPE
table, the same paged KV cache) with no dispatch between the pieces — what CUDA graphs do for
a GPU decode step. It takes the steps of a model whose KV cache is float32 or bfloat16
(``--kv-cache-dtype bfloat16``) and whose linear layers are dense float32 or quantized ones
packed for one of the CPU kernels: integer-dot or bf16-dot
(:mod:`nybble.kernels.cpu.qgemm_pack`, the defaults on CPUs with AVX-512 VNNI / BF16) or float32
weight-only (:mod:`nybble.kernels.cpu.weight_only`, the exact path and the default
elsewhere); GGUF fused projections of up to four block types too; the token embedding dense
or packed the same way. Half-precision weights, an int8 / fp8 KV cache and ``torch.compile``
keep the torch path.

A quantized model runs fused every step its torch path would run on the same kernels: every
step for bf16-dot weights, steps of up to :data:`~nybble.kernels.cpu.weight_only.KERNEL_ROWS`
tokens for weight-only ones (longer steps take the reference dequantization there), and,
where the prefill GEMM is on (``CpuPathLog.prefill_rows``: CPUs with AMX-BF16, or AVX2 ones
running the integer-dot kernel),
steps of fewer tokens than it starts at (longer ones take the torch path and that GEMM); the
projections are then the same kernel calls on either path, so the fused step only removes the
torch ops between them. A dense model that is small (linear weights of at most
:data:`SMALL_MODEL_BYTES`, which stay in the CPU's caches) runs every step fused, prefill and
mixed steps too: each new token becomes a row of its own whose sequence length is its position
+ 1 (it attends to itself and what precedes it), the same causal rule the varlen prefill path
applies.
A larger model runs fused the steps of at most :data:`MAX_FUSED_TOKENS` tokens, decode or
not (decode batches, short prefill chunks, speculative verification of k + 1 positions per
sequence), by the same row-per-token rule; steps of more tokens keep the torch path: its GEMMs
(oneDNN/MKL) beat the fused step's register-tiled dot products there.
``enforce_eager`` turns it off (vLLM's flag for "run the model op by op").

With multi-LoRA on (``model.lora``, :mod:`nybble.models.lora`) the C step gets the model's
stacked adapter slots and each step's row-to-slot map, and adds every row's adapter update
after each projection (``decoder.h``), so steps with adapter rows stay fused too.
"""
from __future__ import annotations

import numpy as np
import torch

from nybble.kernels.cpu.qgemm_pack import QPacked
from nybble.kernels.cpu.weight_only import KERNEL_ROWS, CpuWeight
from nybble.kernels.interface import AttentionMetadata
from nybble.models.linear import DenseLinear
from nybble.models.lora import LoRASlots
from nybble.models.protocols import CausalLMParts

MAX_FUSED_TOKENS = 32
"""Most tokens (rows) a step of a model that is not small may have to run fused. Measured on the
2-core dev machine (one thread, offline greedy decode, fused vs torch tokens/s): stories260k
3,570 vs 630 at 1 sequence, 14,100 vs 5,800 at 16, 16,800 vs 14,500 at 64; stories3m 700 vs 370
at 1, 3,000 vs 2,300 at 16, about even at 64 and 3,100 vs 5,000 at 256; the 134M-shape Llama 84
vs 51 at 4, 133 vs 119 at 16, 87 vs 130 at 64."""
SMALL_MODEL_BYTES = 4 * 2**20
"""Linear-weight bytes up to which a model runs every step fused (the bundled model: 0.9 MB)."""

try:
    from nybble.kernels.cpu.decoder import MAX_PARTS, CpuDecoder, dense_linear
except ImportError:  # pragma: no cover - an install without the compiled extension
    CpuDecoder, MAX_PARTS, dense_linear = None, 0, None

DENSE_HEAD_ROWS = 4
"""Rows below which a float32 LM head on the CPU runs :func:`dense_head` rather than torch's
``linear``. Measured on SmolLM2-135M's tied head ([49152, 576] float32, 113 MB; one thread,
2026-12-06): one row 6.3-6.7 ms against 9.7-10.4 ms (torch's BLAS GEMV reads ~11 GB/s, the
prefetching loop ~17 GB/s); from 4 rows the loop's register tiles carry no prefetch."""

DENSE_HEAD_MIN_BYTES = 4 * 2**20
"""Head bytes from which :func:`dense_head` applies: a head that stays in the CPU's caches is
not memory-bound, and its call costs ~3 us more than torch's (the bundled model's
[512, 64] head: 8 us against 5 us, on a ~100 us step)."""


def dense_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``hidden [S, H] @ weight [V, H]^T`` (float32 logits ``[S, V]``) by the fused step's
    prefetching projection loop, for a float32 CPU head of at least
    :data:`DENSE_HEAD_MIN_BYTES` and fewer than :data:`DENSE_HEAD_ROWS` rows; None when that
    does not apply (the caller uses torch)."""
    if (dense_linear is None or not 0 < hidden.shape[0] < DENSE_HEAD_ROWS
            or weight.numel() * 4 < DENSE_HEAD_MIN_BYTES
            or hidden.device.type != "cpu" or weight.device.type != "cpu"
            or hidden.dtype != torch.float32 or weight.dtype != torch.float32
            or not weight.is_contiguous()):
        return None
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32)
    dense_linear(hidden.detach().contiguous().numpy(), weight.detach().numpy(), out.numpy())
    return out


def _array(t: torch.Tensor | None) -> np.ndarray | None:
    """A numpy view of a float32 CPU tensor (None stays None)."""
    return None if t is None else t.detach().contiguous().numpy()


Weight = np.ndarray | list[QPacked] | list[CpuWeight]
"""A projection's weight as the C step takes it: float32 ``[out, in]`` or packed parts."""


def _cache_array(cache: torch.Tensor) -> np.ndarray:
    """A KV cache as the decoder takes it: float32, or a bfloat16 one's bits as uint16 (numpy
    has no bfloat16); the same memory either way."""
    return cache.view(torch.uint16).numpy() if cache.dtype == torch.bfloat16 else cache.numpy()


def _packed(module: torch.nn.Module) -> QPacked | CpuWeight | None:
    """The module's weight as packed for a CPU kernel (bf16-dot first), or None."""
    packed = getattr(module, "cpu_packed", None)
    return packed if packed is not None else getattr(module, "cpu_weight", None)


def _float32_bias(module: torch.nn.Module) -> np.ndarray | None | bool:
    """The module's bias as float32 numpy (None: no bias; False: not float32)."""
    b = getattr(module, "bias", None)
    if b is None:
        return None
    return _array(b) if b.dtype == torch.float32 else False


def _projection(module: torch.nn.Module) -> tuple[Weight, np.ndarray | None] | None:
    """``(weight, bias)`` of a dense float32 linear or of a quantized one whose parts are all
    packed for one CPU kernel (``cpu_packed`` or ``cpu_weight``), or None (the fused step
    cannot take it)."""
    bias = _float32_bias(module)
    if bias is False:
        return None
    if isinstance(module, DenseLinear):
        return (_array(module.weight), bias) if module.weight.dtype == torch.float32 else None
    parts = list(getattr(module, "parts", [module]))
    packed = [_packed(p) for p in parts]
    if not packed or len(packed) > MAX_PARTS or any(q is None for q in packed):
        return None
    if len({type(q) for q in packed}) > 1:
        return None   # parts on different kernels
    if any(getattr(p, "bias", None) is not None for p in parts if p is not module):
        return None   # a part with its own bias: not a layout the C step knows
    return packed, bias


class FusedCpuDecode:
    """The fused decode step of one model over its KV-cache pool.

    Use :meth:`build`; :meth:`__call__` runs a step or returns None when the step is not a
    plain decode step (the caller then runs the torch path).
    """

    def __init__(self, decoder: CpuDecoder, hidden_size: int,
                 kv_caches: list[torch.Tensor], every_step: bool,
                 max_tokens: int | None = None, defer_from: int | None = None,
                 lora: LoRASlots | None = None) -> None:
        self.decoder = decoder
        self.lora = lora               # the LoRA slots the C step was given, or None
        self.hidden_size = hidden_size
        self.cache_ptrs = tuple(c.data_ptr() for c in kv_caches)
        self.every_step = every_step
        self.max_tokens = max_tokens   # a fixed cap (weight-only quantized models), or None
        self.defer_from = defer_from   # steps of this many tokens take the torch path

    @classmethod
    def build(cls, model: CausalLMParts, kv_caches: list[torch.Tensor]
              ) -> tuple[FusedCpuDecode | None, str]:
        """The fused step for ``model`` over ``kv_caches``, or ``(None, reason)``."""
        if CpuDecoder is None:
            return None, "the compiled nybble.kernels.cpu.decoder extension is missing"
        if model.layout.sharded:
            return None, "tensor-parallel shards (the fused step has no collectives)"
        why = _unfused_feature(model)
        if why:
            return None, f"{why} (the fused step computes a Llama block only)"
        norm = model.norm.weight
        if norm.device.type != "cpu" or norm.dtype != torch.float32:
            return None, f"weights must be float32 on the CPU, got {norm.dtype} on {norm.device}"
        quant_embed = getattr(model, "quant_embed", None)
        embed: Weight | QPacked | None
        if quant_embed is not None:
            embed = _packed(quant_embed)
            if embed is None:
                return None, "the quantized token embedding is not packed for a CPU kernel"
        elif model.embed_tokens.weight.dtype != torch.float32:
            return None, (f"weights must be float32 on the CPU, got "
                          f"{model.embed_tokens.weight.dtype}")
        else:
            embed = _array(model.embed_tokens.weight)
        cache_dtype = kv_caches[0].dtype
        if (cache_dtype not in (torch.float32, torch.bfloat16)
                or any(c.dtype != cache_dtype or not c.is_contiguous() for c in kv_caches)):
            return None, "the KV cache must be float32 or bfloat16"
        layers, quantized, weight_only = [], False, isinstance(embed, CpuWeight)
        integer = False
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                              mlp.down_proj)]
            if any(p is None for p in parts) or attn.kv_scale is not None:
                return None, (f"layer {i} has projections that are neither float32 nor packed "
                              f"for a CPU kernel (half precision, or a layout no kernel takes)")
            quantized |= any(isinstance(p[0], list) for p in parts)
            integer |= any(isinstance(p[0], list) and isinstance(p[0][0], QPacked)
                           and p[0][0].planes > 0 for p in parts)
            weight_only |= any(isinstance(p[0], list) and isinstance(p[0][0], CpuWeight)
                               for p in parts)
            (qkv_w, qkv_b), (o_w, o_b), (gu_w, gu_b), (down_w, down_b) = parts
            layers.append([_array(layer.input_layernorm.weight), qkv_w, qkv_b, o_w, o_b,
                           _array(layer.post_attention_layernorm.weight), gu_w, gu_b, down_w,
                           down_b, _cache_array(kv_caches[i])])
        attn0 = model.layers[0].self_attn
        eps = {layer.input_layernorm.eps for layer in model.layers}
        eps |= {layer.post_attention_layernorm.eps for layer in model.layers}
        if len(eps) != 1 or model.norm.eps not in eps:
            return None, "the norms' epsilons differ"
        lora = getattr(model, "lora", None)
        decoder = CpuDecoder(embed, _array(norm), _array(model.rotary_emb.cos_sin), layers,
                             attn0.num_heads, attn0.num_kv_heads, eps.pop(), attn0.scale,
                             None if lora is None else _lora_arrays(lora))
        if weight_only:
            defer = _prefill_rows(model) if integer else None
            return (cls(decoder, model.config.hidden_size, kv_caches, False, KERNEL_ROWS,
                        defer_from=defer, lora=lora),
                    f"fused C step (steps of up to {KERNEL_ROWS} tokens: weight-only "
                    f"{'and integer-dot ' if integer else ''}quantized projections"
                    + ("" if defer is None else
                                      f"; from {defer} tokens the {_prefill_dtype(model)} "
                                      f"prefill GEMM") + ")")
        if quantized:
            kind = "integer" if integer else "bf16"
            defer = _prefill_rows(model)
            if defer is not None:
                return (cls(decoder, model.config.hidden_size, kv_caches, True,
                            defer_from=defer, lora=lora),
                        f"fused C step (steps of fewer than {defer} tokens: {kind}-dot "
                        f"quantized projections; longer ones take the "
                        f"{_prefill_dtype(model)} prefill GEMM)")
            return (cls(decoder, model.config.hidden_size, kv_caches, True, lora=lora),
                    f"fused C step (every step: {kind}-dot quantized projections)")
        linear_bytes = sum(a.nbytes for ly in layers for a in ly[1:10] if a is not None)
        every_step = linear_bytes <= SMALL_MODEL_BYTES
        return (cls(decoder, model.config.hidden_size, kv_caches, every_step, lora=lora),
                "fused C step (every step: a small model)" if every_step else
                f"fused C step (steps of up to {MAX_FUSED_TOKENS} tokens)")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata
                 ) -> torch.Tensor | None:
        """Final hidden states ``[T, hidden]`` float32 of the step (K/V written), or None
        when it is not one this model runs fused: other caches than it was built for, or more
        tokens than its cap (a dense model that is not small: :data:`MAX_FUSED_TOKENS`; a
        weight-only quantized one: ``KERNEL_ROWS``).

        Raises:
            ValueError: an index out of range (token id, position, slot, block id); nothing
                was written.
        """
        tokens = input_ids.shape[0]
        if len(kv_caches) != len(self.cache_ptrs) or kv_caches[0].data_ptr() != self.cache_ptrs[0]:
            return None
        cap = self.max_tokens if self.max_tokens is not None else MAX_FUSED_TOKENS
        if tokens > cap and not self.every_step:
            return None
        if self.defer_from is not None and tokens >= self.defer_from:
            return None
        tables = meta.block_tables.numpy()
        if meta.is_decode_only and tables.shape[0] == tokens:
            seq_lens = meta.seq_lens.numpy()
        else:   # one row per token: its sequence's blocks, position + 1 keys
            rows = np.repeat(np.arange(tables.shape[0]), np.diff(meta.query_start_loc.numpy()))
            tables = tables[rows]
            seq_lens = positions.numpy() + 1
        out = torch.empty(tokens, self.hidden_size, dtype=torch.float32)
        rows = None if self.lora is None else self.lora.rows
        self.decoder.forward(_int64(input_ids), _int64(positions), _int64(meta.slot_mapping),
                             np.ascontiguousarray(tables, dtype=np.int32),
                             np.ascontiguousarray(seq_lens, dtype=np.int32), out.numpy(),
                             lora_slots=None if rows is None else _int64(rows.token_slots))
        return out


def _prefill_dtype(model: CausalLMParts) -> str:
    """The quantized layers' ``CpuPathLog.prefill_dtype``."""
    return next(m.path_log.prefill_dtype for m in model.modules() if hasattr(m, "path_log"))


def _prefill_rows(model: CausalLMParts) -> int | None:
    """The quantized layers' ``CpuPathLog.prefill_rows`` (None: no prefill GEMM)."""
    log = next((m.path_log for m in model.modules() if hasattr(m, "path_log")), None)
    return None if log is None else log.prefill_rows


def _unfused_feature(model: LlamaForCausalLM) -> str | None:
    """What the model's family needs that the fused step lacks, or None."""
    spec = model.spec
    windows = [layer.self_attn.window for layer in model.layers]
    checks = (("mixture-of-experts layers", spec.moe is not None),
              ("per-head q/k norms", spec.qk_norm), ("Gemma norms", spec.gemma_norm),
              ("Gemma's extra norms", spec.sandwich_norms),
              (f"the {spec.activation} activation", spec.activation != "silu"),
              ("scaled embeddings", spec.embed_scale),
              ("attention soft-capping", spec.attn_softcap is not None),
              ("final soft-capping", spec.final_softcap is not None),
              ("sliding-window layers", any(w is not None for w in windows)),
              ("several RoPE tables", len(model.rotary_embs) > 1),
              ("partial rotary dimensions", model.rotary_emb.partial))
    return next((what for what, needed in checks if needed), None)


def _lora_arrays(lora: LoRASlots) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per layer, the ``(a [S, R, in], B^T [S, R, out])`` numpy views of the qkv, o,
    gate/up and down slots (``lora_b`` is the transposed view of a contiguous ``[S, R, out]``
    tensor, so ``B^T`` is that tensor, shared: later slot writes are seen)."""
    def pair(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        bt = b.transpose(1, 2)
        assert a.is_contiguous() and bt.is_contiguous() and a.dtype == torch.float32
        return a.numpy(), bt.numpy()
    return [[pair(*stack[field]) for field in ("qkv", "o_proj", "gate_up", "down")]
            for stack in lora.stacks]


def _int64(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.numpy(), dtype=np.int64)
