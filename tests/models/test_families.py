"""Qwen3, Phi-3, Gemma 2 and Gemma 3 text equal transformers (float32): prefill logits of
prompts of different lengths (longer than the sliding window), and through the engine (CPU
backend, chunked prefill, prefix caching on, one mixed batch) every prompt logprob and greedy
continuations token for token."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.runtime.llm_engine import LLMEngine

from .hf_families import FAMILIES, WINDOW, make_family_model
from .hf_reference import check_engine_matches_transformers, hf_logits

PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 40)), [1] + list(range(100, 117)), [7]]
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = make_family_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_prefill_logits_match_transformers(family) -> None:
    path, hf = family
    loaded = load_model(ModelConfig(model=path), TorchAttentionBackend(), torch.device("cpu"))
    assert max(len(p) for p in PROMPTS) > WINDOW
    for ours, ids in zip(prefill_logits(loaded, PROMPTS), PROMPTS):
        torch.testing.assert_close(ours, hf_logits(hf, ids), atol=TOL, rtol=0)


def test_engine_matches_transformers(family) -> None:
    path, hf = family
    engine = LLMEngine.from_engine_args(path, max_num_batched_tokens=16, max_num_seqs=4,
                                        block_size=8)
    check_engine_matches_transformers(engine, hf, TOL)
