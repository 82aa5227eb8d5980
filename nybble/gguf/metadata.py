"""GGUF metadata -> the Hugging Face files nybble reads (``config.json``,
``generation_config.json``, ``tokenizer_config.json``).

Keys: ggml's ``docs/gguf.md`` (``general.architecture``, ``{arch}.block_count``,
``{arch}.embedding_length``, ``{arch}.attention.head_count[_kv]``, ``{arch}.rope.*``,
``tokenizer.ggml.*``, ``tokenizer.chat_template``), mapped onto transformers' field names
the way transformers' own GGUF integration does (``GGUF_CONFIG_MAPPING``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nybble.errors import UnsupportedModelError
from nybble.gguf.arch_config import ARCH_FIELDS

ARCHITECTURES = tuple(ARCH_FIELDS)
"""The GGUF ``general.architecture`` values nybble loads (:mod:`nybble.gguf.arch_config`)."""


def _get(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def hf_config(meta: dict[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of a GGUF model.

    Args:
        meta: the GGUF metadata.
        tensors: the file's tensors by name (:class:`~nybble.gguf.reader.GGUFTensor`; a
            separate ``output.weight`` means untied embeddings, ``blk.0.attn_q.bias`` q/k/v
            biases; the rows of ``token_embd.weight`` are the vocabulary; Phi-3's
            ``rope_factors_*`` values are read).

    Raises:
        UnsupportedModelError: an architecture other than :data:`ARCHITECTURES`, a missing
            key, partial rotary embeddings (but Phi-3's), Llama 3.1's ``rope_freqs``, a RoPE
            scaling other than linear, or what a family refuses
            (:mod:`nybble.gguf.arch_config`).
    """
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCH_FIELDS:
        raise UnsupportedModelError(f"GGUF general.architecture must be one of "
                                    f"{', '.join(ARCHITECTURES)}, got {arch!r}")

    def need(name: str) -> Any:
        key = f"{arch}.{name}"
        if key not in meta:
            raise UnsupportedModelError(f"GGUF metadata must contain {key!r} for a {arch} model")
        return _get(meta, key)

    def read(name: str, default: Any) -> Any:
        return _get(meta, f"{arch}.{name}", default)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    need("block_count")
    family = ARCH_FIELDS[arch](read, tensors)
    kv_heads = int(read("attention.head_count_kv", heads))
    head_dim = int(family.get("head_dim") or read("attention.key_length", hidden // heads))
    rot = int(read("rope.dimension_count", head_dim))
    if rot != head_dim and "partial_rotary_factor" not in family:
        raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count must equal the head "
                                    f"dimension {head_dim} (no partial rotary), got {rot}")
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError("GGUF rope_freqs.weight (Llama 3.1 frequency factors) is "
                                    "not supported; supported RoPE: default and linear")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    embed = tensors.get("token_embd.weight")
    vocab = int(read("vocab_size", len(tokens)))
    if embed is not None and getattr(embed, "shape", None):
        vocab = int(embed.shape[0])    # NOTE: Gemma 3's converter drops the unused rows
    cfg: dict[str, Any] = {
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(read("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(read("context_length", 2048)),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    scaling = read("rope.scaling.type", None)
    if scaling not in (None, "none") and "rope_parameters" not in family:
        if scaling != "linear":
            raise UnsupportedModelError(f"GGUF {arch}.rope.scaling.type must be none or linear, "
                                        f"got {scaling!r}")
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(read("rope.scaling.factor", 1.0))}
    cfg.update(family)
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
