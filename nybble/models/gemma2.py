"""Gemma 2 (``Gemma2ForCausalLM``; Gemma Team, "Gemma 2: Improving Open Language Models at a
Practical Size", 2024): ``(1 + w)`` RMSNorms, extra norms on the attention and MLP outputs,
embeddings scaled by ``sqrt(hidden_size)``, a GELU-tanh gated MLP, softmax scale
``query_pre_attn_scalar ** -0.5``, tanh soft-capping of the attention scores and of the final
logits, and local (sliding) / global layers alternating (``layer_types``)."""
from __future__ import annotations

from typing import Any

from nybble.models.arch import ArchSpec, sliding_windows
from nybble.models.hf_config import HFConfig


def gemma_common(config: HFConfig) -> dict[str, Any]:
    """The switches Gemma 2 and 3 share (as :class:`ArchSpec` keyword arguments)."""
    bias = bool(getattr(config, "attention_bias", False))
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    return dict(qkv_bias=bias, o_bias=bias, gemma_norm=True, sandwich_norms=True,
                activation=act or "gelu_pytorch_tanh", embed_scale=True,
                attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
                attn_softcap=_cap(getattr(config, "attn_logit_softcapping", None)),
                final_softcap=_cap(getattr(config, "final_logit_softcapping", None)),
                windows=sliding_windows(config))


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def gemma2_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of a Gemma 2 config."""
    return ArchSpec(**gemma_common(config))
