"""Scheduler behaviour through the Python API, with no model (fake sampled tokens)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from nybble.runtime.scheduler.scheduler import Scheduler

from nybble.errors import KVCacheExhaustedError
from tests.runtime.helpers import (
    IMPLS,
    add_all,
    check_state_invariants,
    constant_sampler,
    make_requests,
    make_scheduler,
    run_to_completion,
    step,
)


@pytest.fixture(params=list(IMPLS.values()), ids=list(IMPLS))
def impl(request: pytest.FixtureRequest) -> type:
    """The scheduler under test: the Cython one, and the plain-Python reference (the same
    assertions pin both; the oracle tests then compare them step by step)."""
    return request.param


def test_budget_and_seq_cap_respected(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_seqs=3, max_num_batched_tokens=10)
    add_all(sched, make_requests(7, prompt_len=6, max_tokens=5))
    peak_seqs = 0
    while sched.has_unfinished():
        batch, _ = step(sched, cfg, constant_sampler())   # asserts T <= 10 and B <= 3
        peak_seqs = max(peak_seqs, batch.num_seqs)
    assert peak_seqs == 3


def test_fcfs_admission_order(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_seqs=2)
    add_all(sched, make_requests(5, prompt_len=3, max_tokens=2, start_id=10, id_stride=10))
    first_seen: list[int] = []
    while sched.has_unfinished():
        batch, _ = step(sched, cfg, constant_sampler())
        first_seen += [s for s in batch.seq_ids.tolist() if s not in first_seen]
    assert first_seen == [10, 20, 30, 40, 50]


def test_chunked_prefill_splits_long_prompt(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_batched_tokens=16)
    (req,) = make_requests(1, prompt_len=40, max_tokens=2)
    add_all(sched, [req])
    chunks = []
    for _ in range(3):
        batch, (ids, _, _) = step(sched, cfg, constant_sampler())
        chunks.append((batch.num_tokens, int(batch.positions[0]), ids.tolist()))
    assert chunks == [(16, 0, []), (16, 16, []), (8, 32, [0])]   # sampled only when complete


def test_unchunked_prompt_waits_until_it_fits_whole(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_batched_tokens=16, enable_chunked_prefill=False)
    add_all(sched, make_requests(2, prompt_len=[12, 8]))
    batch, _ = step(sched, cfg, constant_sampler())
    assert batch.seq_ids.tolist() == [0] and batch.num_tokens == 12
    batch, _ = step(sched, cfg, constant_sampler())
    assert batch.seq_ids.tolist() == [0, 1] and batch.num_tokens == 9


def test_unchunked_prompt_longer_than_budget_is_chunked_anyway(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_batched_tokens=16, enable_chunked_prefill=False)
    add_all(sched, make_requests(1, prompt_len=40, max_tokens=3))
    batch, _ = step(sched, cfg, constant_sampler())
    assert batch.num_tokens == 16
    assert len(run_to_completion(sched, cfg, constant_sampler())[0]) == 3


def test_preemption_newest_first_and_recompute_completes(impl: type) -> None:
    # 2 sequences x (4 prompt + 12 generated) tokens need 2 x 4 blocks > 6 blocks.
    sched, cfg = make_scheduler(impl, num_blocks=6, block_size=4)
    reqs = make_requests(2, prompt_len=4, max_tokens=12)
    add_all(sched, reqs)
    sampler = lambda b: (100 + b.sample_seq_ids).astype(np.int32)
    while sched.num_preemptions == 0:
        step(sched, cfg, sampler)
    state = sched.debug_state()
    assert state["waiting"] == [1] and state["running"] == [0]   # newest (1) was preempted
    generated_before = state["seqs"][1]["num_tokens"] - 4
    assert generated_before > 0 and state["seqs"][1]["num_computed"] == 0
    recomputed = None
    tokens: dict[int, list[int]] = {0: [], 1: []}
    while sched.has_unfinished():
        batch, (ids, toks, _) = step(sched, cfg, sampler)
        if 1 in batch.seq_ids.tolist() and recomputed is None:   # views: copy now
            row = batch.seq_ids.tolist().index(1)
            qsl = batch.query_start_loc
            recomputed = batch.input_ids[qsl[row]:qsl[row + 1]].copy()
        for i, t in zip(ids.tolist(), toks.tolist()):
            tokens[i].append(t)
    # On readmission, the prompt plus the generated tokens are recomputed as its prefill.
    expected = np.concatenate([reqs[1].token_ids, np.full(generated_before, 101)])
    assert recomputed is not None and np.array_equal(recomputed, expected)
    done = {i: state["seqs"][i]["num_tokens"] - 4 for i in (0, 1)}   # generated so far
    assert len(tokens[0]) == 12 - done[0] and len(tokens[1]) == 12 - done[1]
    assert sched.num_free_blocks == 6


def test_finished_sequence_frees_blocks_in_same_step(impl: type) -> None:
    sched, cfg = make_scheduler(impl, num_blocks=10)
    add_all(sched, make_requests(1, prompt_len=9, max_tokens=1))
    add_all(sched, make_requests(1, prompt_len=5, max_tokens=8, start_id=1, stop_token_ids=(5,)))
    _, (ids, toks, fin) = step(sched, cfg, lambda b: np.array([7, 5], np.int32))
    assert ids.tolist() == [0, 1] and toks.tolist() == [7, 5]
    assert fin.tolist() == [2, 1]                  # length, then stop token
    assert sched.num_free_blocks == 10 and not sched.has_unfinished()


def test_max_model_len_finishes_with_length(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_model_len=10)
    add_all(sched, make_requests(1, prompt_len=8, max_tokens=50))
    assert len(run_to_completion(sched, cfg, constant_sampler())[0]) == 2
    add_all(sched, make_requests(1, prompt_len=10, max_tokens=50))   # prompt == max_model_len
    assert len(run_to_completion(sched, cfg, constant_sampler())[0]) == 1


def test_oversize_and_invalid_requests_rejected(impl: type) -> None:
    sched, _ = make_scheduler(impl, num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(KVCacheExhaustedError, match=r"needs 5 KV blocks.*holds only 4 blocks"):
        sched.add(0, np.arange(10), max_tokens=10)
    with pytest.raises(ValueError, match="non-empty"):
        sched.add(1, [], max_tokens=1)
    with pytest.raises(ValueError, match="max_model_len=64 tokens, got 65"):
        sched.add(2, np.arange(65), max_tokens=1)
    with pytest.raises(ValueError, match="`max_tokens` must be >= 1, got 0"):
        sched.add(3, [1], max_tokens=0)
    sched.add(4, np.arange(8), max_tokens=8)       # exactly the pool: accepted
    with pytest.raises(ValueError, match="must not be in use, got 4"):
        sched.add(4, [1], max_tokens=1)
    assert sched.num_waiting == 1


def test_parallel_sampling_group_shares_blocks_and_copies_on_write(impl: type) -> None:
    sched, cfg = make_scheduler(impl, block_size=4, num_blocks=16)
    add_all(sched, make_requests(1, prompt_len=6, max_tokens=3, start_id=20, num_samples=4))
    batch, (_, toks, _) = step(sched, cfg, lambda b: np.arange(4, dtype=np.int32))
    assert batch.sample_seq_ids.tolist() == [20, 21, 22, 23]
    assert batch.sample_rows.tolist() == [5, 5, 5, 5] and toks.tolist() == [0, 1, 2, 3]
    shared = sched.seq_block_ids(20)
    state = sched.debug_state()
    for sid in (21, 22, 23):
        assert np.array_equal(sched.seq_block_ids(sid), shared)
        assert state["seqs"][sid]["token_ids"][-1] == sid - 20
    assert state["ref_counts"][shared].tolist() == [4, 4]
    batch, _ = step(sched, cfg, constant_sampler())
    # Position 6 lands in the shared partial block 1: three owners copy, the last writes in place.
    assert batch.copy_src.tolist() == [shared[1]] * 3
    assert len(set(batch.copy_dst.tolist()) | {shared[1]}) == 4
    assert sched.debug_state()["ref_counts"][shared].tolist() == [4, 1]
    assert sorted(run_to_completion(sched, cfg, constant_sampler())) == [20, 21, 22, 23]


def test_group_counts_num_samples_toward_seq_cap(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_seqs=4)
    add_all(sched, make_requests(1, prompt_len=3, num_samples=3))
    add_all(sched, make_requests(2, prompt_len=3, start_id=5))
    batch, _ = step(sched, cfg, constant_sampler())
    assert batch.seq_ids.tolist() == [0, 5]        # 3 + 1 = cap; seq 6 waits
    with pytest.raises(ValueError, match=r"`num_samples` must be in \[1, 4\]"):
        sched.add(9, [1], max_tokens=1, num_samples=5)


def test_finish_aborts_waiting_running_and_in_flight(impl: type) -> None:
    sched, cfg = make_scheduler(impl, max_num_seqs=2)
    add_all(sched, make_requests(3, prompt_len=4, max_tokens=10))
    step(sched, cfg, constant_sampler())
    sched.finish(2, 3)                              # waiting
    sched.finish(2, 3)                              # already gone: no-op
    sched.finish(999, 1)                            # unknown: no-op
    batch = sched.schedule()
    sched.finish(0, 3)                              # running and in flight
    ids, _, fin = sched.update(batch, np.zeros(batch.num_sampled, np.int32))
    assert dict(zip(ids.tolist(), fin.tolist())) == {0: 3, 1: 0}
    check_state_invariants(sched, cfg)
    sched.finish(1, 1)
    assert not sched.has_unfinished() and sched.num_free_blocks == cfg["num_blocks"]
    with pytest.raises(ValueError, match="`reason` must be 1, 2 or 3, got 0"):
        sched.finish(1, 0)


def test_batch_protocol_errors(impl: type) -> None:
    sched, _ = make_scheduler(impl)
    add_all(sched, make_requests(1))
    batch = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match=r"`sampled` must have shape \(1,\), got \(2,\)"):
        sched.update(batch, np.zeros(2, np.int32))
    sched.update(batch, np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="stale or foreign batch"):
        sched.update(batch, np.zeros(1, np.int32))
    with pytest.raises(KeyError):
        sched.seq_block_ids(77)


def test_empty_schedule_and_properties(impl: type) -> None:
    sched, _ = make_scheduler(impl, num_blocks=5, block_size=8)
    batch = sched.schedule()
    assert batch.num_seqs == batch.num_tokens == 0 and batch.query_start_loc.tolist() == [0]
    assert (sched.num_blocks, sched.block_size, sched.num_free_blocks) == (5, 8, 5)
    assert (sched.num_running, sched.num_waiting, sched.num_preemptions) == (0, 0, 0)
    with pytest.raises(ValueError, match="`max_num_seqs` must be >= 1, got 0"):
        make_scheduler(impl, max_num_seqs=0)


CONFIGS = st.fixed_dictionaries({
    "num_blocks": st.integers(3, 12), "block_size": st.sampled_from([1, 2, 4, 8]),
    "max_num_seqs": st.integers(1, 6), "max_num_batched_tokens": st.integers(1, 48),
    "max_model_len": st.integers(4, 24), "enable_chunked_prefill": st.booleans()})
ADD = st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 16), st.integers(1, 4),
                st.booleans())
OPS = st.lists(st.one_of(ADD, ADD, st.tuples(st.just("step"), st.integers(0, 2**16)),
                         st.tuples(st.just("finish"), st.integers(0, 1000),
                                   st.sampled_from([1, 3]))), min_size=4, max_size=40)
STOP = 11


@settings(max_examples=100, deadline=None)
@given(cfg=CONFIGS, ops=OPS)
def test_random_operations_keep_invariants_and_lose_nothing(cfg: dict, ops: list) -> None:
    sched = Scheduler(**cfg)
    L, bs = cfg["max_model_len"], cfg["block_size"]
    params: dict[int, tuple[int, int, bool]] = {}  # seq id -> (prompt len, max_tokens, stop?)
    parents: list[int] = []
    produced: dict[int, list[int]] = {}
    finished: dict[int, int] = {}
    rng = np.random.default_rng(0)
    sampler = lambda b: rng.integers(0, 12, b.num_sampled).astype(np.int32)

    def record(out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        for i, t, f in zip(*(a.tolist() for a in out)):
            if f == 3:                             # finished via finish() while in flight
                assert i in finished
                continue
            assert i not in finished, f"seq {i} produced a token after finishing"
            produced.setdefault(i, []).append(t)
            if f:
                finished[i] = f

    next_id = 0
    for op in ops:
        if op[0] == "add":
            P, M, n = min(op[1], L), op[2], min(op[3], cfg["max_num_seqs"])
            prompt = np.arange(P, dtype=np.int32) % 10       # never the stop id
            if -(-min(P + M, L) // bs) > cfg["num_blocks"]:
                with pytest.raises(KVCacheExhaustedError):
                    sched.add(next_id, prompt, M, (STOP,) if op[4] else (), n)
                continue
            sched.add(next_id, prompt, M, (STOP,) if op[4] else (), n)
            params.update({next_id + i: (P, M, op[4]) for i in range(n)})
            parents.append(next_id)
            next_id += n
        elif op[0] == "step":
            rng = np.random.default_rng(op[1])
            record(step(sched, cfg, sampler)[1])
        else:
            live = sorted(sched.debug_state()["seqs"])
            if live:
                victim = live[op[1] % len(live)]
                sched.finish(victim, op[2])
                finished[victim] = 10 + op[2]       # marks "finished via finish()"
                check_state_invariants(sched, cfg)
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        record(step(sched, cfg, sampler)[1])
    assert not sched.has_unfinished() and sched.num_free_blocks == cfg["num_blocks"]
    assert not np.any(sched.debug_state()["ref_counts"])
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"forked group: {any(i not in parents for i in produced)}")
    assert set(parents) <= set(finished) and set(produced) <= set(finished)
    for i, toks in produced.items():
        P, M, has_stop = params[i]
        assert len(toks) <= min(M, max(L - P, 1))
        if has_stop:
            assert STOP not in toks[:-1]
        if finished[i] == 2:
            assert len(toks) == min(M, max(L - P, 1)) and not (has_stop and toks[-1] == STOP)
        elif finished[i] == 1:
            assert has_stop and toks[-1] == STOP


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 16),
       num_requests=st.integers(2, 8), seed=st.integers(0, 2**16), chunked=st.booleans())
def test_pool_pressure_preempts_and_still_completes_everything(
        block_size: int, num_blocks: int, num_requests: int, seed: int, chunked: bool) -> None:
    """Every request fits the pool alone but not together: preemption must sort it out."""
    sched, cfg = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=4,
                                max_num_batched_tokens=12, max_model_len=64,
                                enable_chunked_prefill=chunked)
    rng = np.random.default_rng(seed)
    pool_tokens = num_blocks * block_size
    lengths: dict[int, int] = {}
    for i in range(num_requests):
        total = int(rng.integers(pool_tokens // 2, pool_tokens + 1))
        P = int(rng.integers(1, total))
        n = int(rng.integers(1, 3))
        sched.add(10 * i, np.full(P, 3, np.int32), total - P, (), n)
        lengths.update({10 * i + k: total - P for k in range(n)})
    tokens = run_to_completion(sched, cfg, constant_sampler())
    assert {i: len(t) for i, t in tokens.items()} == lengths
    event(f"preempted: {sched.num_preemptions > 0}")
