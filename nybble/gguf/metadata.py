"""GGUF metadata -> the Hugging Face files nybble reads (``config.json``,
``generation_config.json``, ``tokenizer_config.json``).

Keys: ggml's ``docs/gguf.md`` (``general.architecture``, ``{arch}.block_count``,
``{arch}.embedding_length``, ``{arch}.attention.head_count[_kv]``, ``{arch}.rope.*``,
``tokenizer.ggml.*``, ``tokenizer.chat_template``), mapped onto transformers' field names
the way transformers' own GGUF integration does (``GGUF_CONFIG_MAPPING``).
"""
from __future__ import annotations

from typing import Any

from nybble.errors import UnsupportedModelError

ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"),
                 "qwen2": ("Qwen2ForCausalLM", "qwen2")}
"""GGUF ``general.architecture`` -> (transformers architecture, ``model_type``)."""


def _get(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The ``config.json`` of a GGUF model.

    Args:
        meta: the GGUF metadata. tensor_names: the file's tensor names (a separate
            ``output.weight`` means untied embeddings; ``blk.0.attn_q.bias``, q/k/v biases).

    Raises:
        UnsupportedModelError: an architecture other than :data:`ARCHITECTURES`, a
            mixture-of-experts model (``expert_count`` > 0), a missing key, partial rotary
            embeddings, or a RoPE scaling other than linear.
    """
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF general.architecture must be one of "
                                    f"{', '.join(ARCHITECTURES)}, got {arch!r}")
    hf_arch, model_type = ARCHITECTURES[arch]

    def need(name: str) -> Any:
        key = f"{arch}.{name}"
        if key not in meta:
            raise UnsupportedModelError(f"GGUF metadata must contain {key!r} for a {arch} model")
        return _get(meta, key)

    experts = int(_get(meta, f"{arch}.expert_count", 0) or 0)
    if experts:
        raise UnsupportedModelError(
            f"GGUF {arch}.expert_count must be 0 (a dense model): mixture-of-experts GGUF files "
            f"are not supported, got {experts} experts; serve the model's Hugging Face folder "
            f"(safetensors) instead")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_get(meta, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_get(meta, f"{arch}.attention.key_length", hidden // heads))
    rot = int(_get(meta, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count must equal the head "
                                    f"dimension {head_dim} (no partial rotary), got {rot}")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError("GGUF rope_freqs.weight (Llama 3.1 frequency factors) is "
                                    "not supported; supported RoPE: default and linear")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_get(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_get(meta, f"{arch}.context_length", 2048)),
        "vocab_size": int(_get(meta, f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    scaling = _get(meta, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type must be none or linear, "
                                        f"got {scaling!r}")
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(_get(meta, f"{arch}.rope.scaling.factor"))}
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    else:
        cfg["use_sliding_window"] = False
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = _get(meta, f"tokenizer.ggml.{name}")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json``: BOS/EOS ids (``tokenizer.ggml.eos_token_id`` and, when
    present, ``tokenizer.ggml.eot_token_id``, llama.cpp's end-of-turn token)."""
    eos = [int(_get(meta, f"tokenizer.ggml.{k}")) for k in ("eos_token_id", "eot_token_id")
           if _get(meta, f"tokenizer.ggml.{k}") is not None]
    out: dict[str, Any] = {"eos_token_id": sorted(set(eos), key=eos.index)}
    bos = _get(meta, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    return out


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """``tokenizer_config.json``: the chat template, the special-token strings it sees and
    whether BOS is added (``tokenizer.ggml.add_bos_token``)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    out: dict[str, Any] = {"clean_up_tokenization_spaces": False}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        idx = _get(meta, f"tokenizer.ggml.{name}")
        if idx is not None and 0 <= int(idx) < len(tokens):
            out[key] = str(tokens[int(idx)])
    add_bos = _get(meta, "tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        out["add_bos_token"] = bool(add_bos)
    template = _get(meta, "tokenizer.chat_template")
    if isinstance(template, str):
        out["chat_template"] = template
    return out
