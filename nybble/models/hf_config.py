"""A model folder's ``config.json`` read without transformers (the engine core's start-up).

transformers' config classes fill in what a ``config.json`` leaves out, and importing them
costs about as much as torch itself; the engine core needs only the fields its Llama-family
decoder reads. :class:`HFConfig` holds the file's values over the defaults of transformers'
``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Qwen3MoeConfig``,
``MixtralConfig``, ``Phi3Config``, ``Gemma2Config`` and ``Gemma3TextConfig`` (the
architectures nybble builds), with the same
derived fields (``head_dim``, ``num_key_value_heads``, Qwen's ``sliding_window``, Gemma's
``layer_types``) and RoPE parameters in transformers' standard form (``rope_parameters`` with ``rope_type`` and
``rope_theta``). Tests compare every field nybble reads with ``AutoConfig``'s.
"""
from __future__ import annotations

import json
import os
from typing import Any

# transformers' defaults of the fields nybble reads, by architecture
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "num_attention_heads": 32, "num_hidden_layers": 32, "hidden_size": 4096,
           "head_dim": None}
_GEMMA = {**_COMMON, "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh",
          "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
          "sliding_window": 4096, "bos_token_id": 2, "eos_token_id": 1}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {**_COMMON, "vocab_size": 32000, "intermediate_size": 11008,
                         "attention_bias": False, "mlp_bias": False,
                         "num_key_value_heads": None, "max_position_embeddings": 2048,
                         "bos_token_id": 1, "eos_token_id": 2},
    "MistralForCausalLM": {**_COMMON, "vocab_size": 32000, "intermediate_size": 14336,
                           "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                           "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "Qwen2ForCausalLM": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016,
                         "num_key_value_heads": 32, "max_position_embeddings": 32768,
                         "use_sliding_window": False, "sliding_window": 4096,
                         "bos_token_id": None, "eos_token_id": None},
    "Qwen3ForCausalLM": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016,
                         "num_key_value_heads": 32, "head_dim": 128,
                         "max_position_embeddings": 32768, "attention_bias": False,
                         "use_sliding_window": False, "sliding_window": 4096,
                         "max_window_layers": 28, "bos_token_id": None, "eos_token_id": None},
    "Qwen3MoeForCausalLM": {**_COMMON, "vocab_size": 151936, "hidden_size": 2048,
                            "intermediate_size": 6144, "num_hidden_layers": 24,
                            "num_key_value_heads": 4, "max_position_embeddings": 32768,
                            "attention_bias": False, "use_sliding_window": False,
                            "sliding_window": None, "bos_token_id": None, "eos_token_id": None,
                            "num_local_experts": 128, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768, "norm_topk_prob": False,
                            "decoder_sparse_step": 1, "mlp_only_layers": []},
    "MixtralForCausalLM": {**_COMMON, "vocab_size": 32000, "intermediate_size": 14336,
                           "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                           "rms_norm_eps": 1e-5, "sliding_window": None, "bos_token_id": 1,
                           "eos_token_id": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
    "Phi3ForCausalLM": {**_COMMON, "vocab_size": 32064, "hidden_size": 3072,
                        "intermediate_size": 8192, "num_key_value_heads": None,
                        "max_position_embeddings": 4096,
                        "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                        "sliding_window": None, "bos_token_id": 1, "eos_token_id": 32000},
    "Gemma2ForCausalLM": {**_GEMMA, "vocab_size": 256000, "max_position_embeddings": 8192,
                          "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "Gemma3ForCausalLM": {**_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072,
                          "final_logit_softcapping": None, "attn_logit_softcapping": None},
}
# local/global pattern of configs without ``layer_types`` (transformers' __post_init__):
# every ``n``-th layer is global
_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
_DEFAULT_THETA = 10000.0
_ARCH_THETA = {"MixtralForCausalLM": 1_000_000.0}   # architectures with another default
_GEMMA3_KINDS = ("sliding_attention", "full_attention")
_ORIGINAL_LENGTH_ROPE_TYPES = ("llama3", "yarn", "longrope")


class HFConfig:
    """``config.json`` as attributes (``config.hidden_size``), transformers' defaults filled in.

    A field that is neither in the file nor defaulted raises ``AttributeError``, so
    ``getattr(config, name, default)`` behaves as with a transformers config.

    Args:
        raw: the parsed ``config.json``.
    """

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        archs = list(raw.get("architectures") or [])
        defaults = next((_DEFAULTS[a] for a in archs if a in _DEFAULTS), {})
        values = {**defaults, **raw}
        heads = values.get("num_attention_heads")
        if values.get("head_dim") is None and heads:
            values["head_dim"] = values["hidden_size"] // heads
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = heads
        if "use_sliding_window" in values and not values["use_sliding_window"]:
            values["sliding_window"] = None      # NOTE: as Qwen2Config does
        arch = next((a for a in archs if a in _DEFAULTS), None)
        if arch in _SLIDING_PATTERN and not values.get("layer_types"):
            n = int(raw.get("sliding_window_pattern", _SLIDING_PATTERN[arch]))
            values["layer_types"] = ["sliding_attention" if (i + 1) % n else "full_attention"
                                     for i in range(int(values["num_hidden_layers"]))]
        if arch == "Gemma3ForCausalLM":
            values["rope_parameters"] = gemma3_rope_parameters(raw)
        else:
            theta = _ARCH_THETA.get(arch or "", _DEFAULT_THETA)
            values["rope_parameters"] = _rope_parameters(raw, values, theta)
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"config.json has no {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The file's values (no defaults)."""
        return dict(self.raw)


def _rope_parameters(raw: dict[str, Any], values: dict[str, Any],
                     default_theta: float = _DEFAULT_THETA) -> dict[str, Any]:
    """``rope_parameters`` (or the older ``rope_scaling``) with ``rope_type``, ``rope_theta``
    (``default_theta`` when the file has none) and, for the scaled types that need it,
    ``original_max_position_embeddings``."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    if params["rope_type"] in _ORIGINAL_LENGTH_ROPE_TYPES:
        params.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings",
                                  values.get("max_position_embeddings")))
    return params


def gemma3_rope_parameters(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"sliding_attention": {...}, "full_attention": {...}}`` from a Gemma 3 ``config.json``,
    as ``Gemma3TextConfig.convert_rope_params_to_dict`` reads it (the older ``rope_scaling`` /
    ``rope_theta`` / ``rope_local_base_freq`` fields included)."""
    params = {k: dict(v) for k, v in (raw.get("rope_parameters") or {}).items()
              if k in _GEMMA3_KINDS}
    full = params.setdefault("full_attention", {"rope_type": "default"})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local = params.setdefault("sliding_attention", {"rope_type": "default"})
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    for p in params.values():
        p.setdefault("rope_type", p.pop("type", "default"))
    return params


def load_hf_config(model_dir: str) -> HFConfig:
    """Read ``model_dir/config.json``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a JSON object.
    """
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):  # NOTE: a bad file, not a bad argument: one CLI line
        raise ValueError(  # noqa: TRY004
            f"config.json must hold a JSON object, got {type(raw).__name__} in {model_dir}")
    return HFConfig(raw)
