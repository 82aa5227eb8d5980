"""Qwen3-MoE and Mixtral equal transformers (float32): prefill logits of prompts of different
lengths, and through the engine (CPU, chunked prefill, prefix caching, one mixed batch) every
prompt logprob and greedy continuations token for token; the fused CPU step declines MoE
models with its reason; experts that do not split over the tensor-parallel ranks are refused
(TP=2 equals TP=1: tests/distributed/test_tp_moe.py)."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble.config import ModelConfig
from nybble.distributed.comm import TPGroup
from nybble.errors import UnsupportedModelError
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.hf_config import load_hf_config
from nybble.models.loader import load_model
from nybble.models.moe import MoEBlock
from nybble.models.registry import arch_spec
from nybble.models.scoring import prefill_logits
from nybble.models.shape import ModelShape
from nybble.models.tp_layout import TPLayout
from nybble.runtime.llm_engine import LLMEngine

from .hf_moe import MOE_FAMILIES, make_moe_model
from .hf_reference import check_engine_matches_transformers, hf_logits

PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 40)), [1] + list(range(100, 117)), [7]]
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = make_moe_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_sparse_and_dense_layers_follow_the_config(family) -> None:
    path, hf = family
    loaded = load_model(ModelConfig(model=path), TorchAttentionBackend(), torch.device("cpu"))
    ours = [isinstance(layer.mlp, MoEBlock) for layer in loaded.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs and any(ours)
    assert loaded.model.cuda_graph_blocker() is None   # float experts: the Triton kernel


def test_prefill_logits_match_transformers(family) -> None:
    path, hf = family
    loaded = load_model(ModelConfig(model=path), TorchAttentionBackend(), torch.device("cpu"))
    for ours, ids in zip(prefill_logits(loaded, PROMPTS), PROMPTS):
        torch.testing.assert_close(ours, hf_logits(hf, ids), atol=TOL, rtol=0)


def test_engine_matches_transformers(family, caplog) -> None:
    path, hf = family
    with caplog.at_level(logging.INFO, logger="nybble.runtime.worker.model_runner"):
        engine = LLMEngine.from_engine_args(path, max_num_batched_tokens=16, max_num_seqs=4,
                                            block_size=8)
    # the fused C step computes a Llama block only: the torch path runs, and the log says why
    assert "CPU decode step: the torch path, not the fused C step: mixture-of-experts layers " \
           "(the fused step computes a Llama block only)" in caplog.text
    assert engine.engine_core.runner.model.fused_decode is None
    check_engine_matches_transformers(engine, hf, TOL)


def test_experts_that_do_not_split_over_the_ranks_are_refused(tmp_path) -> None:
    path = make_moe_model("qwen3-moe", str(tmp_path))    # moe_intermediate_size 32
    config = load_hf_config(path)
    shape = ModelShape.from_hf_config(config)
    moe = arch_spec(config).moe
    assert moe is not None
    layout = TPLayout.of(shape, config.intermediate_size, TPGroup(rank=1, world_size=2),
                         moe.intermediate_size)
    assert layout.expert_inter is not None and layout.expert_down_in is not None
    assert (layout.expert_inter.start, layout.expert_inter.length) == (16, 16)
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size .* must split "
                       "evenly over tensor_parallel_size 4, got 34"):
        TPLayout.of(shape, 96, TPGroup(rank=0, world_size=4), 34)


def test_lora_on_a_moe_model_is_refused(family) -> None:
    path, _ = family
    loaded = load_model(ModelConfig(model=path), TorchAttentionBackend(), torch.device("cpu"))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        loaded.model.enable_lora(2, 8)
    assert loaded.model.lora is None
