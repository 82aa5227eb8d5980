"""Continuous batching, preemption and abort change no output and leak no KV block."""
from __future__ import annotations

import random

import pytest

from nybble import SamplingParams
from nybble.runtime.llm_engine import LLMEngine
from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine


def _requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]
        out.append((prompt, rng.randrange(1, 48)))
    return out


def _run_to_end(engine: LLMEngine, finals: dict[str, list[int]]) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids


@pytest.fixture(scope="module")
def solo_outputs() -> dict[int, list[int]]:
    """Each request run alone (greedy)."""
    engine = make_engine(max_num_seqs=1)
    outs = {}
    for i, (prompt, max_tokens) in enumerate(_requests(64)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        finals: dict[str, list[int]] = {}
        _run_to_end(engine, finals)
        outs[i] = finals[str(i)]
    return outs


@pytest.mark.slow
def test_staggered_arrivals_match_solo_runs(solo_outputs) -> None:
    engine = make_engine(max_num_seqs=24, max_num_batched_tokens=128)
    reqs = _requests(64)
    finals: dict[str, list[int]] = {}
    pending = list(enumerate(reqs))
    while pending or engine.has_unfinished_requests():
        # Add a few requests every step, while others are mid-generation.
        for _ in range(min(len(pending), 3)):
            i, (prompt, max_tokens) = pending.pop(0)
            engine.add_request(str(i), prompt,
                               SamplingParams(temperature=0, max_tokens=max_tokens))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        stats = engine.get_stats()
        used_slots = (stats.num_blocks - stats.num_free_blocks) * stats.block_size
        # Every live token sits in an allocated slot; less than one block per sequence is idle.
        assert used_slots - 16 * stats.num_running < stats.num_live_tokens <= used_slots or \
            stats.num_running == 0
    assert engine.get_stats().peak_num_seqs_in_step > 8
    for i in range(64):
        assert finals[str(i)] == solo_outputs[i], f"request {i}"
    assert_idle_and_clean(engine)


@pytest.mark.slow
def test_preemption_recomputes_to_the_same_tokens(solo_outputs) -> None:
    # 10 blocks x 16 tokens = 160 slots: far fewer than the 64 requests need together.
    engine = make_engine(max_num_seqs=16, num_gpu_blocks=10)
    reqs = _requests(64)
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    finals: dict[str, list[int]] = {}
    _run_to_end(engine, finals)
    assert engine.get_stats().num_preemptions > 0
    for i in range(64):
        assert finals[str(i)] == solo_outputs[i], f"request {i}"
    assert_idle_and_clean(engine)


def test_random_aborts_leak_no_blocks() -> None:
    rng = random.Random(1)
    engine = make_engine(max_num_seqs=8, num_gpu_blocks=24)
    live: set[str] = set()
    for i, (prompt, max_tokens) in enumerate(_requests(40, seed=2)):
        n = rng.choice([1, 1, 2, 3])
        params = SamplingParams(temperature=0.8, seed=i, n=n, max_tokens=max_tokens)
        engine.add_request(str(i), prompt, params)
        live.add(str(i))
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
    while engine.has_unfinished_requests():
        engine.step()
        if live and rng.random() < 0.1:
            victim = live.pop()
            engine.abort_request(victim)
    assert_idle_and_clean(engine)
