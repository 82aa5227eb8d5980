"""nybble reads config.json without transformers: every field its decoder reads equals
transformers' AutoConfig (defaults and derived fields included), and the RoPE frequencies it
computes equal transformers' ROPE_INIT_FUNCTIONS."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nybble.config import DEFAULT_MODEL
from nybble.models.hf_config import HFConfig, load_hf_config
from nybble.models.layers import RotaryEmbedding, _rope_config
from nybble.models.shape import ModelShape
from tests.conftest import shared_folders
from tests.models.hf_tiny import VARIANTS, make_tiny_model

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "hidden_act",
          "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
          "architectures")
OPTIONAL = ("attention_bias", "mlp_bias", "sliding_window", "use_sliding_window")
MINIMAL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 96, "vocab_size": 512}
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
         "Qwen2ForCausalLM": "qwen2"}


def _assert_same(folder: str) -> None:
    ours, hf = load_hf_config(folder), AutoConfig.from_pretrained(folder)
    for name in FIELDS:
        assert getattr(ours, name) == getattr(hf, name), name
    for name in OPTIONAL:
        assert getattr(ours, name, None) == getattr(hf, name, None), name
    assert _rope_config(ours) == _rope_config(hf)
    assert ModelShape.from_hf_config(ours) == ModelShape.from_hf_config(hf)  # head_dim, KV heads


# Hugging Face folders only (models/smollm2-135m-instruct holds a GGUF file, no config.json)
FOLDERS = [DEFAULT_MODEL] + [f for f in shared_folders("models/*", "fixtures/quant/tiny-*")
                             if not isinstance(f, str) or os.path.isfile(os.path.join(f, "config.json"))]


@pytest.mark.parametrize("folder", FOLDERS, ids=os.path.basename)
def test_real_folders_read_as_transformers_reads_them(folder: str) -> None:
    _assert_same(folder)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiny_variants_read_as_transformers_reads_them(tmp_path, name: str) -> None:
    _assert_same(make_tiny_model(name, str(tmp_path)))


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("extra", [{}, {"use_sliding_window": True, "sliding_window": 64},
                                   {"rope_scaling": {"type": "linear", "factor": 2.0},
                                    "rope_theta": 5e5}],
                         ids=["minimal", "sliding", "linear-rope"])
def test_missing_fields_get_transformers_defaults(tmp_path, arch: str, extra: dict) -> None:
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**MINIMAL, **extra, "architectures": [arch], "model_type": ARCHS[arch]}, f)
    _assert_same(str(tmp_path))


@pytest.mark.parametrize("rope", [
    {},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 64}},
], ids=["default", "linear", "llama3", "yarn"])
def test_rope_frequencies_equal_transformers(tmp_path, rope: dict) -> None:
    raw = {**MINIMAL, "hidden_size": 256, "max_position_embeddings": 256, **rope,
           "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    hf = AutoConfig.for_model("llama", **{k: v for k, v in raw.items() if k != "model_type"})
    rope_type = _rope_config(hf)["rope_type"]
    init = (LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rope_type])
    inv, scale = init(hf) if rope_type == "default" else init(hf, "cpu")
    pos = torch.arange(256, dtype=torch.float32)[:, None] * inv.float()[None, :]
    ours = RotaryEmbedding(HFConfig(raw), 64, 256, torch.device("cpu"))
    cos, sin = pos.cos() * scale, pos.sin() * scale
    # the table is full width: cos = [c, c], sin = [-s, s] (rotation = x cos + roll(x) sin)
    torch.testing.assert_close(ours.cos_sin[:, 0], torch.cat((cos, cos), -1), rtol=0, atol=0)
    torch.testing.assert_close(ours.cos_sin[:, 1], torch.cat((-sin, sin), -1), rtol=0, atol=0)


MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "num_local_experts")


@pytest.mark.parametrize("arch,model_type", [("Qwen3MoeForCausalLM", "qwen3_moe"),
                                             ("MixtralForCausalLM", "mixtral")])
def test_moe_configs_read_as_transformers_reads_them(tmp_path, arch: str,
                                                     model_type: str) -> None:
    """Missing MoE fields get transformers' defaults (Mixtral's RoPE theta 1e6 too), and the
    sparse layers and expert count nybble derives agree with transformers' config."""
    from nybble.models.registry import arch_spec

    with open(tmp_path / "config.json", "w") as f:
        json.dump({**MINIMAL, "architectures": [arch], "model_type": model_type}, f)
    _assert_same(str(tmp_path))
    ours, hf = load_hf_config(str(tmp_path)), AutoConfig.from_pretrained(str(tmp_path))
    for name in MOE_FIELDS:
        assert getattr(ours, name, None) == getattr(hf, name, None), name
    moe = arch_spec(ours).moe
    assert moe is not None
    experts = hf.num_experts if arch.startswith("Qwen") else hf.num_local_experts
    assert (moe.num_experts, moe.top_k) == (experts, hf.num_experts_per_tok)
    assert all(moe.sparse_layers) and len(moe.sparse_layers) == hf.num_hidden_layers
