"""Supported architectures and how to build them from a Hugging Face config."""
from __future__ import annotations

from collections.abc import Callable

from nybble.errors import UnsupportedModelError
from nybble.models.hf_config import HFConfig


def _attention_bias(config: HFConfig) -> tuple[bool, bool]:
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


# architecture name -> (q/k/v bias, o_proj bias) rule; every entry is built by LlamaForCausalLM.
_ARCHITECTURES: dict[str, Callable[[HFConfig], tuple[bool, bool]]] = {
    "LlamaForCausalLM": _attention_bias,
    "MistralForCausalLM": _attention_bias,
    "Qwen2ForCausalLM": lambda config: (True, False),
}

SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def projection_bias(config: HFConfig) -> tuple[bool, bool]:
    """``(qkv_bias, o_bias)`` for the config's architecture.

    Raises:
        UnsupportedModelError: the architecture is not one of :data:`SUPPORTED_ARCHITECTURES`.
    """
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch](config)
    raise UnsupportedModelError(
        f"architectures must include one of {', '.join(SUPPORTED_ARCHITECTURES)}, got {archs}")
