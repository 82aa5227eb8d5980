"""``Scheduler.fork`` (beam search) and declined tokens (``-1`` in ``update``), on the Cython
scheduler with fake tokens: block sharing by reference count, copy-on-write of the partial
last block, and the recompute of a declined token."""
from __future__ import annotations

import numpy as np
import pytest
from nybble.runtime.scheduler import Scheduler


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
