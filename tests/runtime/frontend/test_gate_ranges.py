"""The edges of every sampling range through a real engine: what the gate accepts runs to the
end (extreme seeds with several samples, the largest top_k, a top_p that underflows float32),
what it refuses leaves the engine untouched, and the engine serves normally afterwards."""
from __future__ import annotations

import pytest

from nybble import SamplingParams
from nybble.errors import InvalidRequestError
from nybble.runtime.llm_engine import LLMEngine
from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine

PROMPT = "The dog"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine(max_num_seqs=8)


def _finish(engine: LLMEngine, rid: str, params: SamplingParams) -> list[list[int]]:
    engine.add_request(rid, PROMPT, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.request_id == rid
    assert_idle_and_clean(engine)
    return [o.token_ids for o in final.outputs]


@pytest.mark.parametrize("seed", [(1 << 64) - 1, -(1 << 63), (1 << 63) - 1, -1])
def test_extreme_seeds_with_several_samples_run(engine: LLMEngine, seed: int) -> None:
    tokens = _finish(engine, "s", SamplingParams(n=4, temperature=0.8, seed=seed, max_tokens=6))
    assert len(tokens) == 4 and all(len(t) >= 1 for t in tokens)
    if seed != -1:  # seeded: the same again (-1 is no seed)
        again = _finish(engine, "s2", SamplingParams(n=4, temperature=0.8, seed=seed,
                                                     max_tokens=6))
        assert again == tokens


def test_largest_top_k_and_underflowing_top_p(engine: LLMEngine) -> None:
    greedy = _finish(engine, "g", SamplingParams(temperature=0.0, max_tokens=10))
    vocab = engine.vocab_size
    top1 = _finish(engine, "k", SamplingParams(temperature=0.8, top_k=1, max_tokens=10))
    assert top1 == greedy
    assert _finish(engine, "p", SamplingParams(temperature=0.8, top_p=1e-45, seed=3,
                                               max_tokens=10)) == greedy
    _finish(engine, "v", SamplingParams(temperature=0.8, top_k=vocab, max_tokens=4))


@pytest.mark.parametrize("params,param", [
    (SamplingParams(temperature=0.8, seed=1 << 64), "seed"),
    (SamplingParams(temperature=0.8, seed=-(1 << 63) - 1), "seed"),
    (SamplingParams(temperature=0.0, top_k=1 << 63), "top_k"),
    (SamplingParams(logprobs=1 << 40), "logprobs"),
    (SamplingParams(temperature=1e39), "temperature"),
])
def test_the_issue_reproducers_are_refused_and_harm_nothing(
        engine: LLMEngine, params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", PROMPT, params)
    assert info.value.param == param
    assert_idle_and_clean(engine)
    assert _finish(engine, "ok", SamplingParams(temperature=0.0, max_tokens=3))
