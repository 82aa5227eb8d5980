"""Qwen3, Phi-3, Gemma 2 and Gemma 3 config.json files read without transformers equal
transformers' AutoConfig: every field the decoder reads, transformers' defaults for the ones a
file leaves out, the derived layer types / windows, and the RoPE tables built from them."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from nybble.models.arch import layer_types, sliding_windows
from nybble.models.hf_config import HFConfig, load_hf_config
from nybble.models.layers import RotaryEmbedding
from nybble.models.registry import arch_spec
from nybble.models.shape import ModelShape

from .hf_families import FAMILIES, make_family_model

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "max_position_embeddings", "rms_norm_eps",
          "tie_word_embeddings", "eos_token_id", "bos_token_id", "sliding_window",
          "attention_bias")
GEMMA_FIELDS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "hidden_activation")
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
               "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
MINIMAL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 7,
           "intermediate_size": 96, "vocab_size": 512}


def _tables(config, spec) -> list[torch.Tensor]:
    shape = ModelShape.from_hf_config(config)
    return [RotaryEmbedding(config, shape.head_dim, 80, torch.device("cpu"), p).cos_sin
            for p in spec.rope_params or (None,)]


def _hf_tables(hf, ours_spec) -> list[torch.Tensor]:
    shape = ModelShape.from_hf_config(hf)
    if ours_spec.rope_params:   # Gemma 3: one table per layer type, in the spec's order
        kinds = ("sliding_attention", "full_attention")
        return [RotaryEmbedding(hf, shape.head_dim, 80, torch.device("cpu"),
                                hf.rope_parameters[k]).cos_sin for k in kinds]
    return [RotaryEmbedding(hf, shape.head_dim, 80, torch.device("cpu")).cos_sin]


def _assert_same(folder: str) -> None:
    ours, hf = load_hf_config(folder), AutoConfig.from_pretrained(folder)
    arch = ours.architectures[0]
    names = FIELDS + (GEMMA_FIELDS if arch.startswith("Gemma") else ())
    for name in names:
        assert getattr(ours, name, None) == getattr(hf, name, None), name
    assert ModelShape.from_hf_config(ours) == ModelShape.from_hf_config(hf)
    assert layer_types(ours) == layer_types(hf)
    if hasattr(hf, "layer_types"):   # Phi-3 has none: every layer slides when it has a window
        assert layer_types(ours) == list(hf.layer_types)
    assert sliding_windows(ours) == sliding_windows(hf)
    spec = arch_spec(ours)
    for a, b in zip(_tables(ours, spec), _hf_tables(hf, spec), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tiny_family_configs_read_as_transformers_reads_them(tmp_path, name: str) -> None:
    _assert_same(make_family_model(name, str(tmp_path)))


@pytest.mark.parametrize("arch", sorted(MODEL_TYPES))
@pytest.mark.parametrize("extra", [
    {}, {"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 3},
    {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}],
    ids=["minimal", "sliding", "linear-rope"])
def test_missing_fields_get_transformers_defaults(tmp_path, arch: str, extra: dict) -> None:
    if arch == "Phi3ForCausalLM" and "rope_scaling" in extra:
        pytest.skip("Phi3Config allows only longrope scaling (the tiny variant has one)")
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**MINIMAL, **extra, "architectures": [arch],
                   "model_type": MODEL_TYPES[arch]}, f)
    _assert_same(str(tmp_path))


def test_gemma3_legacy_rope_fields(tmp_path) -> None:
    """``rope_local_base_freq`` and ``rope_scaling`` (files written before
    ``rope_parameters``) give transformers' local and global tables."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**MINIMAL, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                   "rope_theta": 2e5, "rope_local_base_freq": 5e3, "sliding_window_pattern": 3,
                   "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, f)
    _assert_same(str(tmp_path))
    assert layer_types(HFConfig(json.load(open(tmp_path / "config.json")))).count(
        "full_attention") == 2
