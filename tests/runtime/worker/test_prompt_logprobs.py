"""Prompt logprobs (vLLM's ``prompt_logprobs``) and ``max_tokens=0``: every value equals
transformers' float32 log-softmax of the same prompt within 1e-4, whatever else is batched,
with chunked prefill and prefix caching on, and a prompt that fills the whole context."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError
from nybble.runtime.scheduler.scheduler import Scheduler
from tests.conftest import shared_path

from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine, run_requests

TOL = 1e-4


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[P, vocab]`` float32 log-softmax of transformers' logits over the prompt ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(hf: torch.nn.Module, ids: list[int],
                          got: list[dict[int, float] | None], k: int) -> None:
    """``got`` holds ``None`` first, then per token its own logprob and the top ``k``
    (ids and values) of transformers' distribution at the position before it."""
    ref = hf_logprobs(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i]
        assert entry is not None
        assert abs(entry[ids[i]] - ref[i - 1, ids[i]].item()) < TOL, i
        top_lp, top_ids = ref[i - 1].topk(k)
        for tid, lp in zip(top_ids.tolist(), top_lp.tolist()):
            if tid in entry:
                assert abs(entry[tid] - lp) < TOL
            else:   # a near tie at the k-th place may pick another id of the same value
                assert abs(lp - top_lp[-1].item()) < TOL
        assert set(entry) - set(top_ids.tolist()) <= {ids[i]}


def heldout_prompts(tokenizer, num: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """``num`` prompts cut from the held-out stories, of growing lengths (token ids)."""
    with open(shared_path("data", "stories-heldout.txt"), encoding="utf-8") as f:
        text = f.read()
    lengths = np.linspace(min_tokens, max_tokens, num).astype(int)
    return [tokenizer.encode(text[3000 * i:3000 * i + 2000])[:int(n)]
            for i, n in enumerate(lengths)]


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_in_a_mixed_batch(hf) -> None:
    # a small step budget chunks the long prompts; prefix caching is on (the default)
    engine = make_engine(max_num_batched_tokens=48, max_num_seqs=8, block_size=16)
    assert engine.engine_core.config.cache_config.enable_prefix_caching
    tok = engine.tokenizer
    prompts = heldout_prompts(tok, 6, 5, 150)
    shared = prompts[-1]
    requests = [
        # computed first without prompt logprobs: its blocks enter the prefix cache
        ("warm", shared, SamplingParams(temperature=0.0, max_tokens=4)),
    ]
    run_requests(engine, requests)
    hits_before = engine.get_stats().num_cached_tokens_total
    mixed = [(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3))
             for i, ids in enumerate(prompts)]
    mixed.insert(2, ("gen", shared[:100], SamplingParams(temperature=0.8, seed=1,
                                                         max_tokens=20)))
    mixed.append(("again", shared, SamplingParams(max_tokens=0, prompt_logprobs=0)))
    finals = run_requests(engine, mixed)
    # "gen" reused the cached prefix; the requests that score the same prompt did not
    assert engine.get_stats().num_cached_tokens_total - hits_before == 96
    for i, ids in enumerate(prompts):
        out = finals[f"p{i}"]
        check_prompt_logprobs(hf, ids, out.prompt_logprobs, 3)
        assert len(out.outputs[0].token_ids) == 3
    assert finals["gen"].prompt_logprobs is None
    again = finals["again"]
    ref = hf_logprobs(hf, shared)
    assert again.outputs[0].token_ids == [] and again.outputs[0].text == ""
    assert again.outputs[0].finish_reason == "length"
    for i in range(1, len(shared)):
        assert list(again.prompt_logprobs[i]) == [shared[i]]
        assert abs(again.prompt_logprobs[i][shared[i]] - ref[i - 1, shared[i]].item()) < TOL
    assert_idle_and_clean(engine)


def test_max_tokens_zero_scores_a_prompt_that_fills_the_context(hf) -> None:
    engine = make_engine(max_model_len=64, max_num_batched_tokens=64)
    ids = heldout_prompts(engine.tokenizer, 1, 64, 64)[0]
    assert len(ids) == 64
    out = run_requests(engine, [("full", ids, SamplingParams(max_tokens=0, prompt_logprobs=2))])
    out = out["full"]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    check_prompt_logprobs(hf, ids, out.prompt_logprobs, 2)
    # without max_tokens, a full prompt leaves no room: still refused
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("none", ids, SamplingParams(max_tokens=None))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("one", ids, SamplingParams(max_tokens=1))
    assert e.value.param == "max_tokens"
    assert_idle_and_clean(engine)


def test_max_tokens_zero_without_prompt_logprobs_and_with_n() -> None:
    engine = make_engine()
    out = run_requests(engine, [("z", "Once upon a time", SamplingParams(max_tokens=0, n=3))])["z"]
    assert [o.token_ids for o in out.outputs] == [[], [], []]
    assert {o.finish_reason for o in out.outputs} == {"length"}
    assert out.prompt_logprobs is None
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("params, param", [
    (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    (SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
    (SamplingParams(max_tokens=-1), "max_tokens"),
])
def test_gate_ranges(params: SamplingParams, param: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", "Once", params)
    assert e.value.param == param


def test_scheduler_skip_prefix_cache_computes_every_position() -> None:
    sched = Scheduler(32, 4, 4, 64, 64, enable_prefix_caching=True)
    prompt = np.arange(3, 23, dtype=np.int32)
    sched.add(0, prompt, 1)
    batch = sched.schedule()
    sched.update(batch, np.zeros(batch.num_sampled, np.int32))
    sched.add(1, prompt, 1, skip_prefix_cache=True)
    sched.add(2, prompt, 1)
    batch = sched.schedule()
    # seq 1 computes all 20 tokens, seq 2 takes 4 cached blocks (16 tokens) and computes 4
    assert batch.num_tokens == 24
    assert int(batch.positions[0]) == 0 and int(batch.positions[20]) == 16
    assert sched.num_prefix_hit_tokens == 16
