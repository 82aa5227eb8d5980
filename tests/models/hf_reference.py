"""What the family tests compare with: transformers' logits and greedy tokens, and the check
that the engine (CPU, chunked prefill, prefix caching, one mixed batch) reproduces them."""
from __future__ import annotations

import torch

from nybble import SamplingParams
from nybble.runtime.llm_engine import LLMEngine
from tests.runtime.engine_helpers import assert_idle_and_clean, run_requests


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` of one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``ids`` (no KV cache: a full forward each)."""
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(hf, out)[-1].argmax()))
    return out[len(ids):]


def check_engine_matches_transformers(engine: LLMEngine, hf: torch.nn.Module,
                                      tol: float) -> None:
    """Prompts of 5 to 32 tokens in one batch after a warm-up request whose blocks one of them
    reuses (prefix cache): every prompt logprob within ``tol`` of transformers' and 8 greedy
    tokens equal; the engine idle and clean afterwards. ``engine``: built with
    ``max_num_batched_tokens=16, max_num_seqs=4, block_size=8`` (chunked prefill)."""
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
    check_finals(finals, prompts, hf, tol, 8, unscored=("again",))
    assert_idle_and_clean(engine)


def check_finals(finals: dict, prompts: dict[str, list[int]], hf: torch.nn.Module, tol: float,
                 num_new: int, unscored: tuple[str, ...] = ()) -> None:
    """Each request's prompt logprobs (but the ``unscored`` ones') within ``tol`` of
    transformers' and its ``num_new`` greedy tokens equal to transformers'."""
    for key, ids in prompts.items():
        if key not in unscored:
            ref = hf_logits(hf, ids).log_softmax(-1)
            got = finals[key].prompt_logprobs
            for i in range(1, len(ids)):
                assert abs(got[i][ids[i]] - ref[i - 1, ids[i]].item()) < tol, (key, i)
        assert finals[key].outputs[0].token_ids == hf_greedy(hf, ids, num_new), key
