"""Per-architecture GGUF metadata -> the Hugging Face config fields of that family.

One function per GGUF ``general.architecture`` (:data:`ARCH_FIELDS`); each returns what its
family adds to the fields every architecture shares (:func:`nybble.gguf.metadata.hf_config`).
Keys and defaults follow what llama.cpp writes and assumes (``convert_hf_to_gguf.py``'s
``LlamaModel``, ``Qwen3MoeModel``, ``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel``;
``src/llama-model.cpp`` / ``src/models/*.cpp`` hyperparameter loading; key names from gguf-py's
``constants.py``):

* ``llama`` with ``llama.expert_count`` > 0 is Mixtral (``expert_used_count`` experts per
  token, renormalised: llama.cpp's ``build_moe_ffn`` with ``norm_w``).
* ``qwen3moe``: ``expert_feed_forward_length`` (else ``feed_forward_length /
  expert_used_count``, as llama.cpp); top-k always renormalised (llama.cpp passes ``norm_w =
  true``; transformers' GGUF loader sets ``norm_topk_prob`` likewise) unless the file says
  ``expert_weights_norm``; every layer is sparse (llama.cpp's ``qwen3moe`` has no dense
  layers: its tensor list holds no ``ffn_gate``/``ffn_up``/``ffn_down``).
* ``gemma2``: soft-capping keys (llama.cpp's defaults 50 / 30 when absent), window (default
  4096) on every other layer from layer 0; ``query_pre_attn_scalar`` is not stored: llama.cpp
  takes ``hidden / heads`` for the 46-layer (27B) model and ``key_length`` otherwise.
* ``gemma3``: window on five layers of six when ``sliding_window`` > 0 (else none), local
  RoPE base 10 000 (``rope.freq_base_swa`` when present) unscaled, global base
  ``rope.freq_base`` with the file's linear scaling; ``query_pre_attn_scalar`` as Gemma 2's
  (62 layers: ``hidden / heads``).
* ``phi3``: ``rope.dimension_count`` below the head width is partial rotary;
  ``rope_factors_long`` / ``rope_factors_short`` are LongRoPE's factors (with
  ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``);
  ``attention.sliding_window`` 0 means no window.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from nybble.errors import UnsupportedModelError

Fields = dict[str, Any]
Reader = Callable[[str, Any], Any]   # (key without the arch prefix, default) -> value


def _layer_count(read: Reader) -> int:
    return int(read("block_count", 0))


def _llama(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    bias = "blk.0.attn_q.bias" in tensors
    experts = int(read("expert_count", 0) or 0)
    if not experts:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "attention_bias": bias}
    if bias:
        raise UnsupportedModelError("a mixture-of-experts llama GGUF (Mixtral) must have no "
                                    "attention biases, got blk.0.attn_q.bias")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": experts, "num_experts_per_tok": _used(read, experts),
            "sliding_window": None}


def _used(read: Reader, experts: int) -> int:
    used = int(read("expert_used_count", 0) or 0)
    if not 1 <= used <= experts:
        raise UnsupportedModelError(f"GGUF expert_used_count must be in [1, expert_count = "
                                    f"{experts}], got {used}")
    return used


def _qwen2(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "use_sliding_window": False}


def _qwen3(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "attention_bias": "blk.0.attn_q.bias" in tensors, "use_sliding_window": False}


def _qwen3moe(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    experts = int(read("expert_count", 0) or 0)
    if not experts:
        raise UnsupportedModelError("GGUF qwen3moe.expert_count must be > 0, got 0")
    used = _used(read, experts)
    width = read("expert_feed_forward_length", None)
    if width is None:
        width = int(read("feed_forward_length", 0)) // used
    return {**_qwen3(read, tensors), "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe", "num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": int(width), "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": bool(read("expert_weights_norm", True))}


def _attn_scalar(read: Reader, hidden: int, heads: int, head_dim: int, big: int) -> float:
    """llama.cpp's ``f_attention_scale`` as transformers' ``query_pre_attn_scalar``."""
    return float(hidden // heads if _layer_count(read) == big else head_dim)


def _gemma_common(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": False}


def _gemma2(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    hidden, heads = int(read("embedding_length", 0)), int(read("attention.head_count", 1))
    head_dim = int(read("attention.key_length", hidden // heads))
    n = _layer_count(read)
    window = int(read("attention.sliding_window", 4096))
    return {**_gemma_common(read, tensors), "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2", "head_dim": head_dim,
            "query_pre_attn_scalar": _attn_scalar(read, hidden, heads, head_dim, 46),
            "attn_logit_softcapping": float(read("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(read("final_logit_softcapping", 30.0)),
            "sliding_window": window,
            "layer_types": [_kind(i % 2 < 1) for i in range(n)]}


def _kind(sliding: bool) -> str:
    return "sliding_attention" if sliding else "full_attention"


def _gemma3(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    hidden, heads = int(read("embedding_length", 0)), int(read("attention.head_count", 1))
    head_dim = int(read("attention.key_length", hidden // heads))
    n = _layer_count(read)
    window = int(read("attention.sliding_window", 0) or 0)
    pattern = read("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise UnsupportedModelError(f"GGUF gemma3.attention.sliding_window_pattern must "
                                        f"name {n} layers, got {len(pattern)}")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(n)]
    full: Fields = {"rope_type": "default",
                    "rope_theta": float(read("rope.freq_base", 1_000_000.0))}
    scaling = read("rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(f"GGUF gemma3.rope.scaling.type must be none or "
                                        f"linear, got {scaling!r}")
        full = {**full, "rope_type": "linear", "factor": float(read("rope.scaling.factor", 1))}
    local = {"rope_type": "default", "rope_theta": float(read("rope.freq_base_swa", 10000.0))}
    cap = read("final_logit_softcapping", None)
    return {**_gemma_common(read, tensors), "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text", "head_dim": head_dim,
            "query_pre_attn_scalar": _attn_scalar(read, hidden, heads, head_dim, 62),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": float(cap) if cap else None,
            "sliding_window": window or None,
            "layer_types": [_kind(window > 0 and s) for s in sliding],
            "rope_parameters": {"sliding_attention": local, "full_attention": full}}


def _phi3(read: Reader, tensors: Mapping[str, Any]) -> Fields:
    hidden, heads = int(read("embedding_length", 0)), int(read("attention.head_count", 1))
    head_dim = hidden // heads
    rot = int(read("rope.dimension_count", head_dim))
    window = int(read("attention.sliding_window", 0) or 0)
    out: Fields = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                   "head_dim": head_dim, "sliding_window": window or None}
    if rot != head_dim:
        out["partial_rotary_factor"] = rot / head_dim
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    have = [n in tensors for n in names]
    if any(have) and not all(have):
        raise UnsupportedModelError("a phi3 GGUF must hold both rope_factors_long and "
                                    "rope_factors_short (LongRoPE) or neither")
    if all(have):
        long, short = (_factors(tensors[n], rot) for n in names)
        orig = read("rope.scaling.original_context_length", None)
        if orig is None:
            raise UnsupportedModelError("GGUF phi3.rope.scaling.original_context_length is "
                                        "needed with rope_factors_long/short (LongRoPE)")
        scaling: Fields = {"rope_type": "longrope", "long_factor": long,
                           "short_factor": short,
                           "original_max_position_embeddings": int(orig)}
        attn = read("rope.scaling.attn_factor", None)
        if attn is not None:
            scaling["attention_factor"] = float(attn)
        out["rope_scaling"] = scaling
        out["original_max_position_embeddings"] = int(orig)
    return out


def _factors(t: Any, rot: int) -> list[float]:
    values = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if values.size != rot // 2:
        raise UnsupportedModelError(f"GGUF tensor {t.name} must hold rope.dimension_count / 2 "
                                    f"= {rot // 2} factors, got {values.size}")
    return [float(v) for v in values]


ARCH_FIELDS: dict[str, Callable[[Reader, Mapping[str, Any]], Fields]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3moe": _qwen3moe,
    "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3}
"""GGUF ``general.architecture`` -> its family's config fields (``read`` reads
``{arch}.KEY``; ``tensors`` maps tensor names to :class:`~nybble.gguf.reader.GGUFTensor`)."""
