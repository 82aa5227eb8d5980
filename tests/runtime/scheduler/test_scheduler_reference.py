"""The Cython scheduler against its plain-Python reference (the oracle), step by step.

Random add / schedule / update (with declined tokens) / finish / abort-in-flight / failed-step
(``abort_batch``) / fork (beam search) sequences drive both; every
ScheduledBatch (input ids, positions, slot mapping, block tables, ... -- identical block ids,
since both allocate in the same order), every update() result, the counters, the block pool
and every sequence must match after each operation.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from nybble.runtime.scheduler.scheduler import Scheduler

from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler
from nybble.runtime.scheduler.sequence import FinishReason
from tests.runtime.helpers import assert_same_batch, assert_same_state, step_both

STOP = 11


@st.composite
def configs(draw: st.DrawFn) -> dict:
    """Small pools with max_model_len up to the pool, so requests fit alone but crowd it."""
    num_blocks, block_size = draw(st.integers(3, 12)), draw(st.sampled_from([1, 2, 4]))
    return {"num_blocks": num_blocks, "block_size": block_size,
            "max_num_seqs": draw(st.integers(1, 5)),
            "max_num_batched_tokens": draw(st.integers(1, 24)),
            "max_model_len": draw(st.integers(4, max(4, num_blocks * block_size))),
            "enable_chunked_prefill": draw(st.booleans()),
            "enable_prefix_caching": draw(st.booleans())}


class SchedulerMatchesReference(RuleBasedStateMachine):
    """The model is the reference scheduler itself; the Cython one must agree with it."""

    @initialize(cfg=configs(), stem_seed=st.integers(0, 2**16))
    def start(self, cfg: dict, stem_seed: int) -> None:
        self.cfg = cfg
        self.cy, self.ref = Scheduler(**cfg), ReferenceScheduler(**cfg)
        # Prompts start with a piece of one shared stem, so prefix-cache hits happen.
        self.stem = np.random.default_rng(stem_seed).integers(0, 3, cfg["max_model_len"])
        self.next_id, self.forked = 0, False

    def _both(self, method: str, *args) -> tuple:
        """Call ``method`` on both; they must return equal values or raise the same error."""
        results = []
        for sched in (self.cy, self.ref):
            try:
                results.append(("ok", getattr(sched, method)(*args)))
            except (ValueError, RuntimeError) as exc:
                results.append((type(exc), str(exc)))
        assert results[0][0] == results[1][0], results
        if results[0][0] != "ok":
            assert results[0][1] == results[1][1]
        return results[0][0] == "ok", results[0][1], results[1][1]

    @rule(length=st.floats(0, 1), shared=st.floats(0, 1), max_tokens=st.integers(1, 12),
          num_samples=st.integers(1, 4), stop=st.booleans(), tail_seed=st.integers(0, 99))
    def add(self, length: float, shared: float, max_tokens: int, num_samples: int, stop: bool,
            tail_seed: int) -> None:
        P = max(1, round(length * self.cfg["max_model_len"]))
        n_shared = round(shared * P)
        tail = np.random.default_rng(tail_seed).integers(0, 3, P - n_shared)
        prompt = np.concatenate([self.stem[:n_shared], tail]).astype(np.int32)
        ok, _, _ = self._both("add", self.next_id, prompt, max_tokens, (STOP,) if stop else (),
                              num_samples)
        if ok:
            self.next_id += num_samples

    @rule(seed=st.integers(0, 2**16), abort=st.none() | st.integers(0, 1000),
          fail=st.integers(0, 7), decline=st.integers(0, 3))
    def step(self, seed: int, abort: int | None, fail: int = 1, decline: int = 1) -> None:
        ok, batch, ref_batch = self._both("schedule")
        assert ok
        assert_same_batch(batch, ref_batch)
        if batch.num_seqs == 0:
            return
        self.forked |= not set(batch.sample_seq_ids.tolist()) <= set(batch.seq_ids.tolist())
        live = sorted(self.ref.seqs)
        if abort is not None and live:          # finished while its batch is in flight
            self._both("finish", live[abort % len(live)], FinishReason.ABORTED)
        if fail == 0:   # the step raised: its sequences are aborted, the batch dropped
            got_ids, want_ids = self.cy.abort_batch(batch), self.ref.abort_batch(ref_batch)
            assert got_ids.dtype == want_ids.dtype and np.array_equal(got_ids, want_ids)
            event("failed step")
            return
        # Tokens 0..2 continue the stem's alphabet (more hits); 11 is a stop id.
        sampled = np.random.default_rng(seed).choice([0, 1, 2, 5, STOP], batch.num_sampled)
        if decline == 0:    # beam search waiting for a beam: tokens declined (-1)
            sampled[np.random.default_rng(seed + 1).random(batch.num_sampled) < 0.5] = -1
        got, want = self.cy.update(batch, sampled), self.ref.update(ref_batch, sampled)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.array_equal(a, b), (got, want)

    @rule(pick=st.integers(0, 1000), token=st.integers(0, 2))
    def fork(self, pick: int, token: int) -> None:
        """Beam search's fork of a live sequence (a ValueError on both unless it is running
        with only its last token uncomputed)."""
        live = sorted(self.ref.seqs)
        ready = [s for s in live if self.ref.seqs[s].status == "running"
                 and self.ref.seqs[s].num_computed == len(self.ref.seqs[s].tokens) - 1]
        pool = ready if ready and pick % 4 else live     # mostly forkable ones
        ok, _, _ = self._both("fork", pool[pick % len(pool)] if pool else pick, self.next_id,
                              token)
        if ok:
            self.next_id += 1
            event("forked a beam")

    @rule(pick=st.integers(0, 1000), reason=st.sampled_from(list(FinishReason)))
    def finish(self, pick: int, reason: FinishReason) -> None:
        """A live sequence (or, with NONE, a bad reason: ValueError on both; with no live
        sequence, an unknown id: a no-op on both)."""
        live = sorted(self.ref.seqs)
        self._both("finish", live[pick % len(live)] if live else pick, reason)

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "cy"):
            assert_same_state(self.cy, self.ref)

    def teardown(self) -> None:
        if not hasattr(self, "cy"):
            return
        for step in range(2000):
            if not self.ref.has_unfinished():
                break
            self.step(step, None)
            assert_same_state(self.cy, self.ref)
        assert not self.cy.has_unfinished() and self.cy.num_free_blocks == self.cfg["num_blocks"]
        event(f"preempted: {self.ref.num_preemptions > 0}")
        event(f"prefix hits: {self.ref.num_prefix_hit_tokens > 0}")
        event(f"forked a group: {self.forked}")


SchedulerMatchesReference.TestCase.settings = settings(max_examples=100, stateful_step_count=50,
                                                       deadline=None)
TestSchedulerMatchesReference = SchedulerMatchesReference.TestCase


@pytest.mark.parametrize("chunked", [True, False])
def test_reference_matches_on_a_crowded_pool_with_groups(chunked: bool) -> None:
    """A fixed run that surely preempts, forks, copies on write and hits the prefix cache."""
    cfg = {"num_blocks": 10, "block_size": 2, "max_num_seqs": 4, "max_num_batched_tokens": 8,
           "max_model_len": 20, "enable_chunked_prefill": chunked, "enable_prefix_caching": True}
    cy, ref = Scheduler(**cfg), ReferenceScheduler(**cfg)
    prompt = np.arange(7, dtype=np.int32) % 3
    for sched in (cy, ref):
        sched.add(0, prompt, 6, (), 3)
        sched.add(3, prompt, 9)
        sched.add(4, np.concatenate([prompt, [2, 2]]).astype(np.int32), 8, (STOP,))
    copies = 0
    while ref.has_unfinished():
        batch = step_both(cy, ref, lambda b: (b.sample_seq_ids % 3).astype(np.int32))
        copies += len(batch.copy_src)
        assert_same_state(cy, ref)
    assert ref.num_preemptions > 0 and ref.num_prefix_hit_tokens > 0 and copies > 0
