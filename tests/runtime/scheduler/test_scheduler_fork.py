"""``Scheduler.fork`` (beam search) and declined tokens (``-1`` in ``update``) with fake
tokens: block sharing by reference count, copy-on-write of the partial last block, the
recompute of a declined token, and the plain-Python reference agreeing on all of it."""
from __future__ import annotations

import numpy as np
import pytest
from nybble.runtime.scheduler.scheduler import Scheduler

from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler
from nybble.runtime.scheduler.sequence import FinishReason
from tests.runtime.helpers import assert_same_state, step_both


def _prefill(sched: Scheduler, prompt: list[int], token: int) -> None:
    sched.add(0, np.array(prompt, np.int32), 16)
    batch = sched.schedule()
    sched.update(batch, np.array([token], np.int32))


def test_fork_shares_blocks_then_copies_the_partial_last_block() -> None:
    sched = Scheduler(16, 8, 4, 64, 64)
    _prefill(sched, list(range(1, 11)), 50)              # 10 prompt tokens: blocks 0, 1
    parent_blocks = sched.seq_block_ids(0).tolist()
    assert len(parent_blocks) == 2
    sched.fork(0, 7, 60)
    state = sched.debug_state()
    assert state["seqs"][7]["token_ids"].tolist() == list(range(1, 11)) + [60]
    assert state["seqs"][0]["token_ids"].tolist() == list(range(1, 11)) + [50]
    assert state["seqs"][7]["num_computed"] == 10
    assert sched.seq_block_ids(7).tolist() == parent_blocks
    assert [int(state["ref_counts"][b]) for b in parent_blocks] == [2, 2]
    assert state["running"] == [0, 7] and state["running_weight"] == 2
    batch = sched.schedule()                               # both write position 10 (block 1)
    assert batch.num_seqs == 2
    assert batch.copy_src.tolist() == [parent_blocks[1]]   # partial, shared: copied once
    sched.update(batch, np.array([51, 61], np.int32))
    state = sched.debug_state()
    assert sched.seq_block_ids(0)[0] == sched.seq_block_ids(7)[0]   # the full block stays shared
    assert sched.seq_block_ids(0)[1] != sched.seq_block_ids(7)[1]
    assert int(state["ref_counts"][parent_blocks[0]]) == 2
    sched.finish(0, 3)
    sched.finish(7, 3)
    assert not np.count_nonzero(sched.debug_state()["ref_counts"])


def test_declined_token_is_computed_again() -> None:
    sched = Scheduler(16, 8, 4, 64, 64)
    _prefill(sched, [1, 2, 3], 9)
    batch = sched.schedule()
    _, _, finish = sched.update(batch, np.array([-1], np.int32))
    assert finish.tolist() == [0]
    seq = sched.debug_state()["seqs"][0]
    assert seq["token_ids"].tolist() == [1, 2, 3, 9] and seq["num_computed"] == 3
    batch = sched.schedule()
    assert batch.num_tokens == 1 and batch.input_ids.tolist() == [9]
    assert batch.positions.tolist() == [3]


def test_fork_refuses_bad_calls() -> None:
    sched = Scheduler(16, 8, 4, 64, 64)
    with pytest.raises(ValueError, match="seq_id"):
        sched.fork(0, 1, 5)                                # unknown
    sched.add(0, np.array([1, 2, 3], np.int32), 4)
    with pytest.raises(ValueError, match="seq_id"):
        sched.fork(0, 1, 5)                                # waiting, nothing computed
    batch = sched.schedule()
    with pytest.raises(ValueError, match="update"):
        sched.fork(0, 1, 5)                                # batch in flight
    sched.update(batch, np.array([4], np.int32))
    sched.fork(0, 1, 5)
    with pytest.raises(ValueError, match="new_seq_id"):
        sched.fork(0, 1, 6)                                # id in use
    sched.fork(0, 2, 6)
    sched.fork(0, 3, 6)                                    # 4 running: max_num_seqs
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.fork(0, 4, 6)
    assert sched.debug_state()["running_weight"] == 4


def test_reference_matches_with_beam_forks_and_declines() -> None:
    """A fixed beam-like run on a crowded pool (preemption, prefix hits, copy-on-write): each
    other step a running sequence is pruned and another forked, some tokens are declined;
    the Cython scheduler and its plain-Python reference agree after every operation."""
    cfg = {"num_blocks": 14, "block_size": 2, "max_num_seqs": 5, "max_num_batched_tokens": 8,
           "max_model_len": 24, "enable_chunked_prefill": True, "enable_prefix_caching": True}
    cy, ref = Scheduler(**cfg), ReferenceScheduler(**cfg)
    prompt = np.arange(7, dtype=np.int32) % 3
    for sched in (cy, ref):
        sched.add(0, prompt, 12, (), 3)
        sched.add(3, prompt[:5], 14)
    next_id, forks, declines = 10, 0, 0
    for t in range(300):
        if not ref.has_unfinished():
            break
        def sampler(batch, t=t):
            sampled = (batch.sample_seq_ids % 3).astype(np.int32)
            if t % 3 == 1:
                sampled[::2] = -1       # declined
            return sampled
        batch = step_both(cy, ref, sampler)
        declines += len(batch.sample_seq_ids[::2]) if t % 3 == 1 else 0
        ready = [s for s in sorted(ref.seqs) if ref.seqs[s].status == "running"
                 and ref.seqs[s].num_computed == len(ref.seqs[s].tokens) - 1]
        if t % 2 == 0 and len(ready) >= 2:
            for sched in (cy, ref):
                sched.finish(ready[-1], int(FinishReason.ABORTED))
                sched.fork(ready[0], next_id, t % 3)
            next_id, forks = next_id + 1, forks + 1
        assert_same_state(cy, ref)
    assert not ref.has_unfinished() and cy.num_free_blocks == cfg["num_blocks"]
    assert forks > 3 and declines > 3 and ref.num_preemptions > 0
