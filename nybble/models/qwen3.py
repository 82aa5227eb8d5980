"""Qwen 3 (``Qwen3ForCausalLM``): a Llama block with a per-head RMSNorm on q and k before RoPE
(Qwen team, "Qwen3 Technical Report", 2025), optional ``attention_bias``, sliding windows per
``layer_types`` (off unless ``use_sliding_window``)."""
from __future__ import annotations

from nybble.models.arch import ArchSpec, sliding_windows
from nybble.models.hf_config import HFConfig


def qwen3_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of a Qwen 3 config."""
    bias = bool(getattr(config, "attention_bias", False))
    return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, windows=sliding_windows(config))
