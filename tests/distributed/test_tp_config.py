"""``tensor_parallel_size`` / ``distributed_executor_backend``: vLLM's flags, validation, and
the refused combinations; a rank's shard as loaded (no collectives needed to load)."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from nybble.config import EngineConfig, ModelConfig, ParallelConfig
from nybble.distributed.comm import TPGroup
from nybble.engine_args import add_engine_args, engine_config_from_args
from nybble.errors import UnsupportedModelError
from nybble.kernels import get_attention_backend
from nybble.models.loader import load_model
from tests.conftest import shared_path


def test_flags_reach_the_parallel_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2",
                              "--distributed-executor-backend", "ray"])
    pc = engine_config_from_args(args).parallel_config
    assert pc == ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert EngineConfig.from_kwargs(tensor_parallel_size=3).parallel_config.tensor_parallel_size \
        == 3
    assert EngineConfig().parallel_config == ParallelConfig(1, "mp", 120.0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend must be one of"),
    ({"distributed_timeout_s": 0}, "distributed_timeout_s must be > 0 seconds"),
    ({"tensor_parallel_size": 2, "kv_cache_dtype": "int8"},
     "kv_cache_dtype with tensor_parallel_size > 1 must be 'auto', got 'int8'"),
    ({"tensor_parallel_size": 2, "compilation_level": 3},
     "compilation_level with tensor_parallel_size > 1 must be 0, got 3"),
    ({"tensor_parallel_size": 2, "speculative_config": {"method": "ngram"}},
     "speculative_config with tensor_parallel_size > 1 must be None"),
])
def test_bad_values_and_refused_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_each_rank_loads_its_slices_of_the_bundled_model():
    cpu = torch.device("cpu")
    backend = get_attention_backend("torch", cpu)
    full = load_model(ModelConfig(), backend, cpu).model
    shards = [load_model(ModelConfig(), backend, cpu, TPGroup(r, 2)).model for r in range(2)]
    f0 = full.layers[0]
    q, k = 4 * 8, 2 * 8     # stories260k: 8 heads / 4 KV heads of 8 -> 4 and 2 per rank
    for r, m in enumerate(shards):
        layer = m.layers[0]
        assert (layer.self_attn.num_heads, layer.self_attn.num_kv_heads) == (4, 2)
        w = layer.self_attn.qkv_proj.weight
        fw = f0.self_attn.qkv_proj.weight
        assert torch.equal(w[:q], fw[r * q:(r + 1) * q])
        assert torch.equal(w[q:q + k], fw[64 + r * k:64 + (r + 1) * k])
        assert torch.equal(layer.self_attn.o_proj.weight, f0.self_attn.o_proj.weight[:,
                           r * q:(r + 1) * q])
        assert torch.equal(layer.mlp.down_proj.weight, f0.mlp.down_proj.weight[:,
                           r * 86:(r + 1) * 86])
        assert torch.equal(m.embed_tokens.weight, full.embed_tokens.weight[r * 256:
                                                                           (r + 1) * 256])
        assert torch.equal(layer.input_layernorm.weight, f0.input_layernorm.weight)


def test_a_group_split_by_the_ranks_is_refused_naming_the_layer(tmp_path):
    # the g32 GPTQ fixture, its config claiming 128-wide groups: at TP 4 an o_proj shard has
    # 32 input features, less than one group
    src = shared_path("fixtures", "quant", "tiny-llama-gptq-4bit-g32")
    for name in os.listdir(src):
        if name != "config.json" and name != "quantize_config.json":
            os.symlink(os.path.join(src, name), tmp_path / name)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["group_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedModelError,
                       match=r"o_proj must be a multiple of group_size 128 .* got 32 "
                             r"\(under tensor_parallel_size 4"):
        load_model(ModelConfig(model=str(tmp_path)), get_attention_backend("torch", cpu), cpu,
                   TPGroup(0, 4))
