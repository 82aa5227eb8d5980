"""Gemma 3 text (``Gemma3ForCausalLM``; Gemma Team, "Gemma 3 Technical Report", 2025): Gemma 2's
block (:mod:`nybble.models.gemma2`) plus ``(1 + w)`` RMSNorms on q and k, five local layers per
global one (``layer_types``), and separate RoPE tables: ``rope_parameters["sliding_attention"]``
(base ``rope_local_base_freq``, 10k) for local layers, ``["full_attention"]`` (base 1M, often
linear-scaled) for global ones; no soft-capping by default."""
from __future__ import annotations

from nybble.models.arch import ArchSpec, layer_types
from nybble.models.gemma2 import gemma_common
from nybble.models.hf_config import HFConfig

_KINDS = ("sliding_attention", "full_attention")   # the keys of its rope_parameters


def gemma3_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of a Gemma 3 text config (``rope_parameters`` keyed by layer
    type: :class:`~nybble.models.hf_config.HFConfig` reads them so).

    Raises:
        UnsupportedModelError: ``use_bidirectional_attention`` (nybble's attention is causal).
    """
    if getattr(config, "use_bidirectional_attention", False):
        from nybble.errors import UnsupportedModelError

        raise UnsupportedModelError("use_bidirectional_attention must be false (causal "
                                    "attention only), got true")
    rope = config.rope_parameters
    types = layer_types(config)
    return ArchSpec(**gemma_common(config), qk_norm=True,
                    rope_params=tuple(rope[k] for k in _KINDS),
                    layer_rope=tuple(_KINDS.index(t) for t in types))
