"""The Cython scheduler against its plain-Python reference (the oracle), step by step.

Random add / schedule / update (with declined tokens) / finish / abort-in-flight / failed-step
(``abort_batch``) / fork (beam search) sequences drive both, with or without a sliding window
(blocks out of it freed; then contexts longer than the pool); every
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
from tests.runtime.helpers import (assert_same_batch, assert_same_state,
                                   check_state_invariants, step_both)

STOP = 11


@st.composite
def configs(draw: st.DrawFn, windowed: bool | None = None) -> dict:
    """Small pools with max_model_len up to the pool, so requests fit alone but crowd it; with
    a sliding window (``windowed``; None: half of the draws), up to three times the pool's
    tokens."""
    num_blocks, block_size = draw(st.integers(3, 12)), draw(st.sampled_from([1, 2, 4]))
    windows = st.integers(1, 8)
    window = draw(windows if windowed else st.none() if windowed is False
                  else st.none() | windows)
    longest = max(4, num_blocks * block_size * (3 if window else 1))
    # with a window, contexts mostly past it (else nothing is freed)
    shortest = min(longest, window + 2 * block_size + 4) if window else 4
    return {"num_blocks": num_blocks, "block_size": block_size,
            "max_num_seqs": draw(st.integers(1, 5)),
            "max_num_batched_tokens": draw(st.integers(1, 24)),
            "max_model_len": draw(st.integers(shortest, longest)),
            "enable_chunked_prefill": draw(st.booleans()),
            "enable_prefix_caching": draw(st.booleans()),
            "sliding_window": window}


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
            check_state_invariants(self.ref, self.cfg)

    def teardown(self) -> None:
        if not hasattr(self, "cy"):
            return
        for step in range(4000):     # a windowed crowded pool at 1 token a step: ~2,100
            if not self.ref.has_unfinished():
                break
            self.step(step, None)
            assert_same_state(self.cy, self.ref)
        null = self.cfg["sliding_window"] is not None
        assert self.cy.null_block == (0 if null else -1)
        assert not self.cy.has_unfinished()
        assert self.cy.num_free_blocks == self.cfg["num_blocks"] - null
        event(f"preempted: {self.ref.num_preemptions > 0}")
        event(f"window freed blocks: {self.ref.num_window_freed_blocks > 0}")
        event(f"prefix hits: {self.ref.num_prefix_hit_tokens > 0}")
        event(f"forked a group: {self.forked}")


SchedulerMatchesReference.TestCase.settings = settings(max_examples=100, stateful_step_count=50,
                                                       deadline=None)
TestSchedulerMatchesReference = SchedulerMatchesReference.TestCase


class WindowedSchedulerMatchesReference(SchedulerMatchesReference):
    """The same machine, always with a sliding window (blocks out of it freed), and requests
    that mostly outgrow the window (and often the pool)."""

    @initialize(cfg=configs(windowed=True), stem_seed=st.integers(0, 2**16))
    def start(self, cfg: dict, stem_seed: int) -> None:
        super().start(cfg, stem_seed)
        self.freed_cached = False

    @rule(length=st.floats(0, 1), shared=st.floats(0, 1), max_tokens=st.integers(8, 24),
          num_samples=st.integers(1, 2), tail_seed=st.integers(0, 99))
    def add_long(self, length: float, shared: float, max_tokens: int, num_samples: int,
                 tail_seed: int) -> None:
        """A request that runs long (no stop id)."""
        self.add(length, shared, max_tokens, num_samples, False, tail_seed)

    @rule(seed=st.integers(0, 2**16))
    def steps(self, seed: int) -> None:
        """Several plain steps in a row, so sequences grow past the window."""
        for k in range(4):
            self.step(seed + k, None, 1, 1)

    def teardown(self) -> None:
        if hasattr(self, "cy"):
            event(f"window freed a prefix-cached block: {self.freed_cached}")
        super().teardown()

    @invariant()
    def window_state(self) -> None:
        """Remember whether a block released by the window stayed findable in the cache."""
        if hasattr(self, "cy") and self.ref.prefix_cache is not None \
                and self.ref.num_window_freed_blocks:
            self.freed_cached |= bool(self.ref.prefix_cache.parked)


WindowedSchedulerMatchesReference.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None)
TestWindowedSchedulerMatchesReference = WindowedSchedulerMatchesReference.TestCase


def _run_fixed(cfg: dict, prompt: np.ndarray, max_tokens: tuple[int, int, int]
               ) -> tuple[ReferenceScheduler, int]:
    """Both schedulers run a group of 3 samples of ``prompt``, one more request of it and one
    of it plus two tokens (a stop id), to the end, agreeing (and the reference's invariants
    holding) after every step; the reference and the copy-on-write pairs seen."""
    cy, ref = Scheduler(**cfg), ReferenceScheduler(**cfg)
    for sched in (cy, ref):
        sched.add(0, prompt, max_tokens[0], (), 3)
        sched.add(3, prompt, max_tokens[1])
        sched.add(4, np.concatenate([prompt, [2, 2]]).astype(np.int32), max_tokens[2],
                  (STOP,))
    copies = 0
    while ref.has_unfinished():
        batch = step_both(cy, ref, lambda b: (b.sample_seq_ids % 3).astype(np.int32))
        copies += len(batch.copy_src)
        assert_same_state(cy, ref)
        check_state_invariants(ref, cfg)
    return ref, copies


@pytest.mark.parametrize("chunked", [True, False])
def test_reference_matches_on_a_crowded_pool_with_groups(chunked: bool) -> None:
    """A fixed run that surely preempts, forks, copies on write and hits the prefix cache."""
    cfg = {"num_blocks": 10, "block_size": 2, "max_num_seqs": 4, "max_num_batched_tokens": 8,
           "max_model_len": 20, "enable_chunked_prefill": chunked, "enable_prefix_caching": True}
    ref, copies = _run_fixed(cfg, np.arange(7, dtype=np.int32) % 3, (6, 9, 8))
    assert ref.num_preemptions > 0 and ref.num_prefix_hit_tokens > 0 and copies > 0


@pytest.mark.parametrize("chunked", [True, False])
def test_reference_matches_with_a_window_past_the_pool(chunked: bool) -> None:
    """A fixed windowed run whose sequences outgrow the pool: it surely frees blocks out of
    the window, preempts, forks a group, copies on write and hits the prefix cache (a hit
    partly out of the window), and both schedulers agree at every step."""
    cfg = {"num_blocks": 12, "block_size": 2, "max_num_seqs": 4, "max_num_batched_tokens": 6,
           "max_model_len": 60, "enable_chunked_prefill": chunked, "enable_prefix_caching": True,
           "sliding_window": 5}
    # a group of 3 reaching 43 tokens (> the pool's 22, null block excluded), a request that
    # hits its blocks, and a longer prompt
    ref, copies = _run_fixed(cfg, (np.arange(13, dtype=np.int32) * 7) % 5, (30, 20, 25))
    assert ref.num_window_freed_blocks > 0 and ref.num_preemptions > 0
    assert ref.num_prefix_hit_tokens > 0 and copies > 0
    assert ref.num_free_blocks == cfg["num_blocks"] - 1

