"""Qwen3, Phi-3, Gemma 2 and Gemma 3 text equal transformers (float32): prefill logits of
prompts of different lengths (longer than the sliding window), and through the engine (CPU
backend, chunked prefill, prefix caching on, one mixed batch) every prompt logprob and greedy
continuations token for token."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble import SamplingParams
from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.runtime.llm_engine import LLMEngine
from tests.runtime.engine_helpers import assert_idle_and_clean, run_requests

from .hf_families import FAMILIES, WINDOW, make_family_model

PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 40)), [1] + list(range(100, 117)), [7]]
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = make_family_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(_hf_logits(hf, out)[-1].argmax()))
    return out[len(ids):]


def test_prefill_logits_match_transformers(family) -> None:
    path, hf = family
    loaded = load_model(ModelConfig(model=path), TorchAttentionBackend(), torch.device("cpu"))
    assert max(len(p) for p in PROMPTS) > WINDOW
    for ours, ids in zip(prefill_logits(loaded, PROMPTS), PROMPTS):
        torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=TOL, rtol=0)


def test_engine_matches_transformers(family) -> None:
    path, hf = family
    engine = LLMEngine.from_engine_args(path, max_num_batched_tokens=16, max_num_seqs=4,
                                        block_size=8)
    cfg = engine.engine_core.config
    assert cfg.cache_config.enable_prefix_caching and engine.max_model_len == 256
    shared = list(range(50, 80))
    prompts = {"long": shared, "short": [1, 403, 407, 261, 378], "again": shared + [9, 10],
               "mid": list(range(200, 221))}
    scored = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    run_requests(engine, [("warm", shared, SamplingParams(temperature=0.0, max_tokens=2))])
    # "again" (no prompt logprobs) starts from "warm"'s cached blocks
    finals = run_requests(engine, [(k, ids, plain if k == "again" else scored)
                                   for k, ids in prompts.items()])
    assert engine.get_stats().num_cached_tokens_total >= 24
    for key, ids in prompts.items():
        if key != "again":
            ref = _hf_logits(hf, ids).log_softmax(-1)
            got = finals[key].prompt_logprobs
            for i in range(1, len(ids)):
                assert abs(got[i][ids[i]] - ref[i - 1, ids[i]].item()) < TOL, (key, i)
        assert finals[key].outputs[0].token_ids == _hf_greedy(hf, ids, 8), key
    assert_idle_and_clean(engine)

