"""``Scheduler.abort_batch``: a step that raised between schedule() and update() leaves the
scheduler consistent -- the batch's sequences are gone with their blocks, every other
sequence is untouched, and the next schedule() works (no "schedule() called before update()"
wedge). Both implementations (Cython and the reference) behave the same."""
from __future__ import annotations

import numpy as np
import pytest

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


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
@pytest.mark.parametrize("caching", [False, True])
def test_a_failed_batch_is_aborted_and_the_rest_keeps_running(impl: type, caching: bool) -> None:
    # 2 sequences fit a step (8 tokens budget, prompts of 4): the third waits outside the batch
    sched, cfg = make_scheduler(impl, max_num_batched_tokens=8, max_num_seqs=2,
                                enable_prefix_caching=caching)
    reqs = make_requests(2, prompt_len=4, max_tokens=3) + \
        make_requests(1, prompt_len=4, max_tokens=3, start_id=10, num_samples=2)
    add_all(sched, reqs)
    step(sched, cfg, constant_sampler())      # the first two prefill
    batch = sched.schedule()                  # their decode step ... which raises
    assert batch.seq_ids.tolist() == [0, 1]
    aborted = sched.abort_batch(batch)
    assert aborted.dtype == np.int64 and aborted.tolist() == [0, 1]
    st = check_state_invariants(sched, cfg)
    assert set(st["seqs"]) == {10} and 0 not in sched and 1 not in sched
    assert sched.num_free_blocks == cfg["num_blocks"]   # the group holds none yet
    tokens = run_to_completion(sched, cfg, constant_sampler(5))
    assert tokens == {10: [5, 5, 5], 11: [5, 5, 5]}


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_an_unforked_group_goes_as_a_whole(impl: type) -> None:
    sched, cfg = make_scheduler(impl)
    add_all(sched, make_requests(1, prompt_len=6, max_tokens=4, num_samples=3))
    batch = sched.schedule()
    assert batch.sample_seq_ids.tolist() == [0, 1, 2]
    assert sched.abort_batch(batch).tolist() == [0]
    check_state_invariants(sched, cfg)
    assert not sched.has_unfinished() and sched.num_free_blocks == cfg["num_blocks"]
    assert sched.schedule().num_seqs == 0


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_only_the_pending_batch_can_be_aborted(impl: type) -> None:
    sched, _ = make_scheduler(impl)
    add_all(sched, make_requests(1))
    batch = sched.schedule()
    sched.update(batch, constant_sampler()(batch))
    with pytest.raises(ValueError, match="must be the batch returned by the last schedule"):
        sched.abort_batch(batch)
    batch = sched.schedule()
    sched.abort_batch(batch)
    with pytest.raises(ValueError, match="stale or foreign batch"):
        sched.abort_batch(batch)
    with pytest.raises(ValueError, match="stale or foreign batch"):
        sched.update(batch, constant_sampler()(batch))
