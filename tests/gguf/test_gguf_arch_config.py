"""The per-architecture GGUF metadata rules that the tiny written files do not reach
(:mod:`nybble.gguf.arch_config`): llama.cpp's defaults when a key is absent and its
``query_pre_attn_scalar`` rule for the 27B Gemmas."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from nybble.errors import UnsupportedModelError
from nybble.gguf.metadata import hf_config


def _meta(arch: str, layers: int = 2, **keys: Any) -> dict[str, Any]:
    base = {"general.architecture": arch, f"{arch}.block_count": layers,
            f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 8,
            f"{arch}.feed_forward_length": 96,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    return {**base, **{f"{arch}.{k}": v for k, v in keys.items()}}


def _embd() -> dict[str, Any]:
    return {"token_embd.weight": SimpleNamespace(shape=(512, 64))}


@pytest.mark.parametrize("arch,layers,want", [("gemma2", 46, 8.0), ("gemma2", 42, 16.0),
                                              ("gemma3", 62, 8.0), ("gemma3", 26, 16.0)])
def test_gemma_query_scalar_follows_llama_cpp(arch: str, layers: int, want: float) -> None:
    """Not stored: ``hidden / heads`` for the 27B layer counts, ``key_length`` otherwise."""
    cfg = hf_config(_meta(arch, layers, **{"attention.key_length": 16}), _embd())
    assert cfg["query_pre_attn_scalar"] == want and cfg["head_dim"] == 16


def test_gemma2_defaults_are_llama_cpps() -> None:
    cfg = hf_config(_meta("gemma2", 3), _embd())
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert cfg["sliding_window"] == 4096
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert cfg["vocab_size"] == 512 and cfg["tie_word_embeddings"]


def test_gemma3_window_pattern_and_rope_tables() -> None:
    cfg = hf_config(_meta("gemma3", 7, **{"attention.sliding_window": 512,
                                          "rope.freq_base": 1e6}), _embd())
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention",
                                                              "sliding_attention"]
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg["rope_parameters"]["full_attention"] == {"rope_type": "default",
                                                        "rope_theta": 1e6}
    none = hf_config(_meta("gemma3", 7), _embd())
    assert set(none["layer_types"]) == {"full_attention"} and none["sliding_window"] is None


def test_qwen3moe_defaults_are_llama_cpps() -> None:
    """No ``expert_feed_forward_length``: ``feed_forward_length / expert_used_count``; top-k
    renormalised (llama.cpp's ``norm_w = true``)."""
    cfg = hf_config(_meta("qwen3moe", expert_count=8, expert_used_count=2), _embd())
    assert cfg["moe_intermediate_size"] == 48 and cfg["norm_topk_prob"]
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["mlp_only_layers"] == []


def test_phi3_longrope_needs_both_factor_tensors() -> None:
    t = SimpleNamespace(name="rope_factors_long.weight", data=np.ones(4, np.float32))
    with pytest.raises(UnsupportedModelError, match="rope_factors_long and rope_factors_short"):
        hf_config(_meta("phi3"), {**_embd(), "rope_factors_long.weight": t})

