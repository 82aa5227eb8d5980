"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): a Llama block whose checkpoint stores ``qkv_proj``
and ``gate_up_proj`` fused (Abdin et al., "Phi-3 Technical Report", 2024), with LongRoPE
scaling or ``partial_rotary_factor`` in its RoPE (:class:`nybble.models.layers.RotaryEmbedding`)
and, when ``sliding_window`` is set, every layer sliding."""
from __future__ import annotations

from nybble.models.arch import ArchSpec, sliding_windows
from nybble.models.hf_config import HFConfig


def phi3_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of a Phi-3 config."""
    return ArchSpec(fused_checkpoint=True, windows=sliding_windows(config))
