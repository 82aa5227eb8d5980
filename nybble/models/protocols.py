"""What the decoder's helpers read of a model, as structural types (:class:`typing.Protocol`).

:mod:`nybble.models.layer_ops` (the step as plain callables) and :mod:`nybble.models.cpu_fused`
(the fused CPU decode step) read a decoder layer's and a whole model's parts; the concrete
classes (:mod:`nybble.models.llama`) import those helpers, so the helpers name these
protocols instead of the classes: no import circle, not even one through annotations. The
attributes are the ones :class:`~nybble.models.llama.LlamaForCausalLM` and its layers have.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from nybble.models.hf_config import HFConfig
from nybble.models.layers import RMSNorm, RotaryEmbedding
from nybble.models.tp_layout import TPLayout


class AttentionParts(Protocol):
    """A layer's attention: fused ``qkv_proj`` (``[T, hidden] -> [T, (Hq + 2 Hkv) D]``),
    ``o_proj``, RoPE, the head counts and size, the softmax scale, the per-head KV-cache
    scales (``None``: a float cache) and ``attend(q, k, v, kv_cache, meta) -> [T, Hq D]``."""

    qkv_proj: nn.Module
    o_proj: nn.Module
    rope: RotaryEmbedding
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv_scale: torch.Tensor | None
    attend: Callable[..., torch.Tensor]


class MLPParts(Protocol):
    """A layer's SwiGLU MLP: fused ``gate_up_proj`` and ``down_proj``."""

    gate_up_proj: nn.Module
    down_proj: nn.Module


class DecoderLayerParts(Protocol):
    """One decoder layer: the two norms, attention and MLP (``tp``: the tensor-parallel group
    its row-parallel outputs are all-reduced over, read with ``getattr``)."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    self_attn: AttentionParts
    mlp: MLPParts


class CausalLMParts(Protocol):
    """A whole decoder: its config and tensor-parallel layout, the embedding, the layers, the
    final norm and the rotary table."""

    config: HFConfig
    layout: TPLayout
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm
    rotary_emb: RotaryEmbedding
