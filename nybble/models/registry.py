"""Supported architectures and the :class:`~nybble.models.arch.ArchSpec` each is built with
(every one by :class:`nybble.models.llama.LlamaForCausalLM`)."""
from __future__ import annotations

from collections.abc import Callable

from nybble.errors import UnsupportedModelError
from nybble.models.arch import ArchSpec, sliding_windows
from nybble.models.gemma2 import gemma2_spec
from nybble.models.gemma3 import gemma3_spec
from nybble.models.hf_config import HFConfig
from nybble.models.mixtral import mixtral_spec
from nybble.models.phi3 import phi3_spec
from nybble.models.qwen3 import qwen3_spec
from nybble.models.qwen3_moe import qwen3_moe_spec


def _llama_spec(config: HFConfig) -> ArchSpec:
    """Llama / Mistral: ``attention_bias`` on q/k/v and o; Mistral's window on every layer."""
    bias = bool(getattr(config, "attention_bias", False))
    return ArchSpec(qkv_bias=bias, o_bias=bias, windows=sliding_windows(config))


def _qwen2_spec(config: HFConfig) -> ArchSpec:
    """Qwen 2: bias on q/k/v, none on o; windows per ``layer_types``."""
    return ArchSpec(qkv_bias=True, windows=sliding_windows(config))


_ARCHITECTURES: dict[str, Callable[[HFConfig], ArchSpec]] = {
    "LlamaForCausalLM": _llama_spec,
    "MistralForCausalLM": _llama_spec,
    "Qwen2ForCausalLM": _qwen2_spec,
    "Qwen3ForCausalLM": qwen3_spec,
    "Qwen3MoeForCausalLM": qwen3_moe_spec,
    "MixtralForCausalLM": mixtral_spec,
    "Phi3ForCausalLM": phi3_spec,
    "Gemma2ForCausalLM": gemma2_spec,
    "Gemma3ForCausalLM": gemma3_spec,
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def arch_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of the config's architecture.

    Raises:
        UnsupportedModelError: the architecture is not one of :data:`SUPPORTED_ARCHITECTURES`.
    """
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch](config)
    raise UnsupportedModelError(
        f"architectures must include one of {', '.join(SUPPORTED_ARCHITECTURES)}, got {archs}")

