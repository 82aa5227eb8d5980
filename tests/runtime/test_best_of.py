"""Offline ``best_of``: the ``n`` returned samples are the ``best_of`` candidates with the
highest cumulative logprob (OpenAI/vLLM), best first; the candidates are the samples a seeded
``n = best_of`` request draws (sample ``i`` has its own generator)."""
from __future__ import annotations

from nybble import SamplingParams

from .engine_helpers import assert_idle_and_clean, make_engine, run_requests


def test_best_of_keeps_the_n_best_candidates() -> None:
    engine = make_engine()
    common = {"temperature": 1.0, "seed": 3, "max_tokens": 10}
    every = run_requests(engine, [("all", "Tom had a big", SamplingParams(
        n=5, logprobs=0, **common))])["all"].outputs
    score = {tuple(o.token_ids): sum(next(iter(e.values())) for e in o.logprobs)
             for o in every}
    assert len(score) == 5
    best = run_requests(engine, [("best", "Tom had a big", SamplingParams(
        n=2, best_of=5, **common))])["best"].outputs
    want = sorted(score, key=score.get, reverse=True)[:2]
    assert [tuple(o.token_ids) for o in best] == want
    assert [o.index for o in best] == [0, 1]
    for o in best:
        assert abs(o.cumulative_logprob - score[tuple(o.token_ids)]) < 1e-4
        assert o.logprobs is None   # ranked by logprobs the caller did not ask for
    assert_idle_and_clean(engine)
