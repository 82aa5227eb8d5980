"""The decoder's step as plain callables: what :meth:`LlamaForCausalLM.forward` runs.

A small model's decode step is a few hundred tiny ops, and calling each through
``nn.Module.__call__`` (hook checks) and ``nn.Module.__getattr__`` (parameter lookup) costs
about as much as the ops themselves (~1 ms of a ~3 ms step for the bundled model). So the
modules hold the parameters and the structure, and once, before the first step, each layer is
turned into a :class:`LayerOps`: its norms and projections as plain functions bound to their
weights (``functools.partial`` of ``F.linear`` / ``torch.rms_norm``; quantized linears keep
their bound ``forward``).

The step is cut at attention into segments (embedding and layer 0 up to attention; one layer's
end to the next layer's attention; the last layer's end and the final norm), the pieces that
``torch.compile`` compiles when asked; attention and the KV-cache writes stay eager between
them (vLLM's piecewise compilation).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nybble.distributed.comm import TPGroup
from nybble.kernels.interface import AttentionMetadata
from nybble.models.layers import RotaryEmbedding, silu_and_mul
from nybble.models.linear import as_function
from nybble.models.protocols import DecoderLayerParts

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerOps:
    """One decoder layer as plain callables ``[T, in] -> [T, out]``, plus its attention.

    Attributes:
        input_norm, qkv, o_proj, post_norm, gate_up, down: the layer's norms and (fused)
            projections.
        attend: ``(q, k, v, kv_cache, meta) -> [T, Hq * D]``: KV-cache write and attention.
        rope: the layer's rotary embedding; ``rope_index``: which of the step's ``(cos, sin)``
            pairs it reads (Gemma 3's local and global tables; 0 otherwise).
        num_heads, num_kv_heads, head_dim: the attention geometry.
        act: the gated activation ``[T, 2I] -> [T, I]``.
        q_norm, k_norm: per-head norms of q and k before RoPE (Qwen 3, Gemma 3), or None.
        attn_out_norm, mlp_out_norm: Gemma's norms of the attention and MLP outputs before
            their residual adds, or None.
        moe: the layer's mixture-of-experts block ``[T, hidden] -> [T, hidden]``
            (:class:`nybble.models.moe.MoEBlock`), or None (the dense gated MLP
            ``down(act(gate_up(x)))``; for an MoE layer ``gate_up`` and ``down`` are
            :func:`no_dense_mlp`).
    """

    input_norm: Fn
    qkv: Fn
    o_proj: Fn
    post_norm: Fn
    gate_up: Fn
    down: Fn
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      AttentionMetadata], torch.Tensor]
    rope: RotaryEmbedding
    num_heads: int
    num_kv_heads: int
    head_dim: int
    act: Fn = silu_and_mul
    q_norm: Fn | None = None
    k_norm: Fn | None = None
    attn_out_norm: Fn | None = None
    mlp_out_norm: Fn | None = None
    rope_index: int = 0
    moe: Fn | None = None
    keys_before_rope: bool = False

    @classmethod
    def of(cls, layer: DecoderLayerParts,
           adapt: Callable[[str, Fn], Fn] | None = None) -> LayerOps:
        """The ops of ``layer`` (bound to its current weights).

        Args:
            layer: the decoder layer.
            adapt: ``(field, fn) -> fn`` wrapping the ``qkv``, ``o_proj``, ``gate_up`` and
                ``down`` projections of a dense layer (multi-LoRA:
                :meth:`nybble.models.lora.LoRASlots.adapt`), applied to a row-parallel
                projection before its all-reduce; None: none.
        """
        attn, mlp = layer.self_attn, layer.mlp
        moe = getattr(mlp, "expert_prefixes", None) is not None
        wrap = adapt or (lambda field, fn: fn)
        qkv = wrap("qkv", as_function(attn.qkv_proj))
        o_proj = wrap("o_proj", as_function(attn.o_proj))
        gate_up = no_dense_mlp if moe else wrap("gate_up", as_function(mlp.gate_up_proj))
        down = no_dense_mlp if moe else wrap("down", as_function(mlp.down_proj))
        tp = getattr(layer, "tp", None)
        moe_fn = as_function(mlp) if moe else None
        if tp is not None and tp.world_size > 1:   # row-parallel: sum the ranks' partials
            o_proj = _all_reduced(o_proj, tp)
            if moe_fn is not None:
                moe_fn = _all_reduced(moe_fn, tp)
            else:
                down = _all_reduced(down, tp)
        sandwich = getattr(layer, "sandwich", False)
        pre_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        before_rope = getattr(attn, "rotary_keys", None) is not None
        return cls(as_function(layer.input_layernorm), qkv, o_proj, as_function(pre_mlp),
                   gate_up, down, functools.partial(attn.attend, keys_before_rope=before_rope),
                   attn.rope, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                   getattr(mlp, "act", silu_and_mul), _optional(getattr(attn, "q_norm", None)),
                   _optional(getattr(attn, "k_norm", None)),
                   as_function(layer.post_attention_layernorm) if sandwich else None,
                   as_function(layer.post_feedforward_layernorm) if sandwich else None,
                   getattr(attn, "rope_index", 0), moe_fn, before_rope)


def no_dense_mlp(x: torch.Tensor) -> torch.Tensor:
    """The ``gate_up`` / ``down`` of a mixture-of-experts layer, which has none.

    Raises:
        RuntimeError: always (the layer's MLP is its ``moe`` block).
    """
    raise RuntimeError("a mixture-of-experts layer has no dense gate_up / down projection; "
                       "run its LayerOps.moe block")


def _optional(module: torch.nn.Module | None) -> Fn | None:
    return None if module is None else as_function(module)


def _all_reduced(fn: Fn, tp: TPGroup) -> Fn:
    """``fn`` followed by an all-reduce over ``tp`` (a row-parallel projection)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        return tp.all_reduce(fn(x))
    return run


@dataclass(frozen=True, slots=True)
class ModelOps:
    """The whole decoder as :class:`LayerOps` plus the embedding lookup (``ids [T] ->
    [T, hidden]``; vocabulary-parallel under tensor parallelism), the RoPE tables (one, or
    Gemma 3's local and global) and the final norm."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    ropes: tuple[RotaryEmbedding, ...]
    layers: tuple[LayerOps, ...]
    final_norm: Fn


Rot = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""The step's ``(cos, sin)`` rows of each RoPE table (:meth:`RotaryEmbedding.lookup`)."""


def pre_attention(ops: LayerOps, h: torch.Tensor, rot: Rot
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused q/k/v projection, per-head q/k norms (when the family has them) and RoPE:
    ``h [T, hidden]`` -> rotated ``q [T, Hq, D]``, ``k [T, Hkv, D]`` and ``v [T, Hkv, D]``.
    A layer whose quantized cache holds keys before RoPE (``ops.keys_before_rope``) gets its
    keys unrotated: the attention kernels rotate them as they read them."""
    num_tokens = h.shape[0]
    cos, sin = rot[ops.rope_index]
    qkv = ops.qkv(ops.input_norm(h)).view(num_tokens, -1, ops.head_dim)  # (T, Hq + 2 Hkv, D)
    hq, qk_heads = ops.num_heads, ops.num_heads + ops.num_kv_heads
    if ops.keys_before_rope:
        q, k = qkv[:, :hq], qkv[:, hq:qk_heads]
        if ops.q_norm is not None and ops.k_norm is not None:
            q, k = ops.q_norm(q), ops.k_norm(k)
        return ops.rope.apply(q, cos, sin), k, qkv[:, qk_heads:]
    if ops.q_norm is not None and ops.k_norm is not None:
        q = ops.rope.apply(ops.q_norm(qkv[:, :hq]), cos, sin)
        return q, ops.rope.apply(ops.k_norm(qkv[:, hq:qk_heads]), cos, sin), qkv[:, qk_heads:]
    # q and k are adjacent in the fused output: one rotation covers both.
    qk = ops.rope.apply(qkv[:, :qk_heads], cos, sin)
    return qk[:, :hq], qk[:, hq:], qkv[:, qk_heads:]


def post_attention(ops: LayerOps, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """``o_proj``, both residuals and the gated MLP or MoE block (with Gemma's output norms when the
    family has them): ``attn [T, Hq * D]`` -> the layer's output ``[T, hidden]``."""
    a = ops.o_proj(attn)
    h = h + (a if ops.attn_out_norm is None else ops.attn_out_norm(a))
    x = ops.post_norm(h)
    m = ops.moe(x) if ops.moe is not None else ops.down(ops.act(ops.gate_up(x)))
    return h + (m if ops.mlp_out_norm is None else ops.mlp_out_norm(m))


def first_segment(model: ModelOps, input_ids: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """Embedding, the step's rotary rows (gathered once for every layer) and layer 0 up to
    attention: ``(h, rot, q, k, v)``."""
    h = model.embed(input_ids)
    rot = tuple(rope.lookup(positions, h.dtype) for rope in model.ropes)
    return (h, rot, *pre_attention(model.layers[0], h, rot))


def middle_segment(ops: LayerOps, following: LayerOps, h: torch.Tensor, attn: torch.Tensor,
                   rot: Rot) -> tuple[torch.Tensor, ...]:
    """From one layer's attention output to the next layer's ``(h, q, k, v)``."""
    h = post_attention(ops, h, attn)
    return (h, *pre_attention(following, h, rot))


def last_segment(ops: LayerOps, final_norm: Fn, h: torch.Tensor,
                 attn: torch.Tensor) -> torch.Tensor:
    """The last layer after attention, then the final norm."""
    return final_norm(post_attention(ops, h, attn))


Segments = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]
EAGER_SEGMENTS: Segments = (first_segment, middle_segment, last_segment)


def run_step(model: ModelOps, segments: Segments, input_ids: torch.Tensor,
             positions: torch.Tensor, kv_caches: list[torch.Tensor],
             meta: AttentionMetadata) -> torch.Tensor:
    """The decoder's forward: ``input_ids, positions [T]`` -> final hidden ``[T, hidden]``;
    writes the step's K/V into ``kv_caches``."""
    first, middle, last = segments
    h, rot, q, k, v = first(model, input_ids, positions)
    layers = model.layers
    final = len(layers) - 1
    for i, ops in enumerate(layers):
        attn = ops.attend(q, k, v, kv_caches[i], meta)
        if i == final:
            return last(ops, model.final_norm, h, attn)
        h, q, k, v = middle(ops, layers[i + 1], h, attn, rot)
    raise ValueError("a model needs at least one layer, got 0")
