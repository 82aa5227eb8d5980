"""Plain-Python reference of the continuous-batching scheduler (the tests' oracle).

The rule of scheduler.pyx, written for reading (vLLM V1): every sequence advances
``num_computed`` toward ``num_tokens`` (prompt + generated). Each step, under a token budget
and a sequence cap (an unforked parallel-sampling group counts ``num_samples``):

1. running sequences, oldest first, get ``min(num_tokens - num_computed, budget)`` tokens;
   when the pool is short, the newest running sequence is preempted (blocks freed,
   ``num_computed = 0``, front of waiting; recomputed later) and the allocation is retried;
2. if nobody was preempted, waiting sequences are admitted FCFS while budget, cap and blocks
   allow, each first taking its longest cached prefix of full blocks (at most
   ``num_tokens - 1`` tokens); a prompt over the remaining budget is chunked, or -- chunked
   prefill off -- deferred while it fits the whole budget.

A sequence is sampled iff the step completes its tokens. ``update`` forks groups (siblings
share the blocks; copy-on-write later), advances, caches newly full blocks, appends tokens and
frees finished sequences in the same step. With a ``sliding_window`` W (every layer windowed),
before a sequence's blocks are drawn its leading ``(num_computed - W + 1) // block_size``
blocks are released and become the null block 0 (vLLM's sliding-window KV manager). Same API,
same ScheduledBatch arrays, same block ids and same counters as
:class:`~nybble.runtime.scheduler.scheduler.Scheduler`; slow, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.scheduler.reference_allocator import ReferenceBlockAllocator, prefix_key
from nybble.runtime.scheduler.scheduler_input import check_add, check_sizes, check_window
from nybble.runtime.scheduler.sequence import FinishReason


@dataclass(eq=False)
class ReferenceSequence:
    """One sequence: its tokens, progress and block table (ids of the reference pool)."""

    seq_id: int
    tokens: list[int]
    num_prompt_tokens: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    num_samples: int
    status: str = "waiting"        # waiting | running | finished
    num_computed: int = 0
    num_scheduled: int = 0
    num_hashed: int = 0            # leading full blocks already in the prefix cache
    blocks: list[int] = field(default_factory=list)
    skip_cache: bool = False       # never takes cached blocks (prompt logprobs)
    cache_salt: int = 0            # the root of its prefix chain (a LoRA adapter's; 0: shared)


class ReferenceScheduler:
    """Same constructor, methods and results as
    :class:`nybble.runtime.scheduler.scheduler.Scheduler`."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None):
        check_sizes(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
        window = check_window(sliding_window)
        self.sliding_window = window or None
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.max_num_batched_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.allocator = ReferenceBlockAllocator(num_blocks, block_size, enable_prefix_caching,
                                                 reserve_null_block=window > 0)
        self.null_block = self.allocator.null_block
        self.prefix_cache = self.allocator.prefix_cache
        self.seqs: dict[int, ReferenceSequence] = {}
        self.running: list[ReferenceSequence] = []   # admission order, oldest first
        self.waiting: list[ReferenceSequence] = []   # FCFS; preempted go to the front
        self.num_preemptions = self.num_prefix_hit_tokens = self.num_prefix_query_tokens = 0
        self.num_window_freed_blocks = 0
        self._inflight: ScheduledBatch | None = None
        self._rows: list[ReferenceSequence] = []
        self._samples: list[tuple[ReferenceSequence, int]] = []   # (parent, fork index i)

    # ---- queries ---------------------------------------------------------------------------

    num_running = property(lambda self: len(self.running), doc="Running sequences.")
    num_waiting = property(lambda self: len(self.waiting), doc="Waiting sequences.")
    num_free_blocks = property(lambda self: self.allocator.num_free_blocks,
                               doc="Free blocks (parked cached ones included).")

    def __contains__(self, seq_id: int) -> bool:
        """True when ``seq_id`` is waiting or running."""
        return seq_id in self.seqs

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return bool(self.running or self.waiting)

    def seq_block_ids(self, seq_id: int) -> np.ndarray:
        """Copy of the block table of a waiting or running ``seq_id`` (KeyError otherwise)."""
        return np.array(self.seqs[seq_id].blocks, dtype=np.int32)

    def debug_state(self) -> dict:
        """The keys of ``Scheduler.debug_state()`` (``max_tokens`` as given)."""
        seqs = {s.seq_id: {"status": s.status, "num_prompt_tokens": s.num_prompt_tokens,
                           "num_tokens": len(s.tokens), "num_computed": s.num_computed,
                           "max_tokens": s.max_tokens, "num_samples": s.num_samples,
                           "block_ids": np.array(s.blocks, dtype=np.int32),
                           "token_ids": np.array(s.tokens, dtype=np.int32)}
                for s in self.seqs.values()}
        return {**self.allocator.debug_state(), "seqs": seqs,
                "running": [s.seq_id for s in self.running],
                "waiting": [s.seq_id for s in self.waiting],
                "running_weight": sum(s.num_samples for s in self.running)}

    # ---- requests --------------------------------------------------------------------------

    def add(self, seq_id: int, token_ids, max_tokens: int, stop_token_ids=(),
            num_samples: int = 1, skip_prefix_cache: bool = False,
            cache_salt: int = 0) -> None:
        """Queue a request (FCFS); the checks and errors of ``Scheduler.add``."""
        prompt, stops, _ = check_add(self, seq_id, token_ids, max_tokens, stop_token_ids,
                                     num_samples)
        seq = ReferenceSequence(seq_id, prompt.tolist(), len(prompt), max_tokens,
                                frozenset(stops.tolist()), num_samples,
                                skip_cache=skip_prefix_cache, cache_salt=cache_salt)
        self.seqs[seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq_id: int, reason: int) -> None:
        """End ``seq_id`` now (no-op when unknown); its blocks are freed."""
        if reason not in (FinishReason.STOPPED, FinishReason.LENGTH, FinishReason.ABORTED):
            raise ValueError(f"`reason` must be 1, 2 or 3, got {reason}")
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            (self.running if seq.status == "running" else self.waiting).remove(seq)
            self._release(seq)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's rows (running first, then FCFS admission) and build the batch."""
        if self._inflight is not None and self._inflight.num_seqs > 0:
            raise RuntimeError("schedule() called before update() of the previous batch")
        self._rows, copies = [], []
        budget, preempted = self._schedule_running(self.max_num_batched_tokens, copies)
        self.num_preemptions += preempted
        if not preempted:
            self._schedule_waiting(budget, copies)
        self._inflight = self._build(copies)
        return self._inflight

    def _allocate(self, seq: ReferenceSequence, n: int, copies: list) -> bool:
        if self.sliding_window:     # the step's earliest query reads no key below `first`
            first = seq.num_computed - self.sliding_window + 1
            if first >= self.block_size:   # a late-hashing forked sibling: register first
                self._cache_full_blocks(seq)
            self.num_window_freed_blocks += self.allocator.remove_skipped_blocks(
                seq.blocks, max(first, 0) // self.block_size)
        ok, copy = self.allocator.allocate_slots(seq.blocks, seq.num_computed, n)
        if copy is not None:
            copies.append(copy)
        return ok

    def _schedule_running(self, budget: int, copies: list) -> tuple[int, int]:
        i, preempted = 0, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self._allocate(seq, n, copies):
                victim = self.running.pop()             # the newest running sequence
                self.allocator.free_blocks(victim.blocks)
                victim.num_hashed = victim.num_computed = 0
                victim.status = "waiting"
                self.waiting.insert(0, victim)
                preempted += 1
                if victim is seq:
                    return budget, preempted
            seq.num_scheduled, budget, i = n, budget - n, i + 1
            self._rows.append(seq)
        return budget, preempted

    def _schedule_waiting(self, budget: int, copies: list) -> None:
        bs = self.block_size
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if sum(s.num_samples for s in self.running) + seq.num_samples > self.max_num_seqs:
                return
            hit = 0
            if self.prefix_cache is not None and not seq.skip_cache:
                hits = self.prefix_cache.match(seq.tokens, seq.cache_salt)[
                    :(len(seq.tokens) - 1) // bs]
                for block in hits.tolist():
                    self.allocator.incref(block)
                    seq.blocks.append(block)
                seq.num_hashed, seq.num_computed = len(hits), len(hits) * bs
                hit = seq.num_computed
            n = len(seq.tokens) - seq.num_computed
            deferred = False
            if n > budget:
                deferred = not self.enable_chunked_prefill and n <= self.max_num_batched_tokens
                n = budget
            if deferred or not self._allocate(seq, n, copies):
                self.allocator.free_blocks(seq.blocks)     # give any hits back
                seq.num_hashed = seq.num_computed = 0
                return
            if self.prefix_cache is not None:
                self.num_prefix_hit_tokens += hit
                self.num_prefix_query_tokens += len(seq.tokens)
            self.waiting.pop(0)
            seq.status, seq.num_scheduled = "running", n
            self.running.append(seq)
            self._rows.append(seq)
            budget -= n

    def _build(self, copies: list[tuple[int, int]]) -> ScheduledBatch:
        bs, mb = self.block_size, -(-self.max_model_len // self.block_size)
        ids, pos, slots, lens, qsl, self._samples, sample_rows = [], [], [], [], [0], [], []
        tables = np.full((len(self._rows), mb), -1, dtype=np.int32)
        for b, seq in enumerate(self._rows):
            start, end = seq.num_computed, seq.num_computed + seq.num_scheduled
            for p in range(start, end):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // bs] * bs + p % bs)
            tables[b, :len(seq.blocks)] = seq.blocks
            lens.append(end)
            qsl.append(len(ids))
            if end == len(seq.tokens):
                self._samples += [(seq, i) for i in range(seq.num_samples)]
                sample_rows += [len(ids) - 1] * seq.num_samples
        i32, i64 = np.int32, np.int64
        return ScheduledBatch(
            num_seqs=len(self._rows), num_tokens=len(ids),
            max_query_len=max((s.num_scheduled for s in self._rows), default=0),
            max_seq_len=max(lens, default=0), input_ids=np.array(ids, i32),
            positions=np.array(pos, i64), slot_mapping=np.array(slots, i64),
            block_tables=tables, seq_lens=np.array(lens, i32),
            query_start_loc=np.array(qsl, i32),
            seq_ids=np.array([s.seq_id for s in self._rows], i64),
            sample_rows=np.array(sample_rows, i32),
            sample_seq_ids=np.array([s.seq_id + i for s, i in self._samples], i64),
            copy_src=np.array([c[0] for c in copies], i32),
            copy_dst=np.array([c[1] for c in copies], i32))

    def update(self, batch: ScheduledBatch, sampled) -> tuple[np.ndarray, ...]:
        """Apply a step's results; returns (seq_ids int64, tokens int32, finish int8)."""
        self._check_pending(batch)
        sampled = np.asarray(sampled, dtype=np.int32)
        if sampled.shape != (len(self._samples),):
            raise ValueError(f"`sampled` must have shape ({len(self._samples)},), "
                             f"got {sampled.shape}")
        self._inflight = None
        targets = [self._fork(seq, i) if i else seq for seq, i in self._samples]
        for seq in self._rows:
            if seq.status == "running":
                seq.num_computed += seq.num_scheduled
                seq.num_scheduled = 0
                self._cache_full_blocks(seq)
        finish = []
        for seq, token in zip(targets, sampled.tolist()):
            if seq is None or seq.status != "running":
                finish.append(FinishReason.ABORTED)    # finished while in flight
                continue
            if token < 0:                              # declined: computed again next step
                seq.num_computed -= 1
                finish.append(FinishReason.NONE)
                continue
            seq.tokens.append(token)
            reason = FinishReason.NONE
            if token in seq.stop_token_ids:
                reason = FinishReason.STOPPED
            elif (len(seq.tokens) - seq.num_prompt_tokens >= seq.max_tokens
                  or len(seq.tokens) >= self.max_model_len):
                reason = FinishReason.LENGTH
            finish.append(reason)
            if reason != FinishReason.NONE:
                del self.seqs[seq.seq_id]
                self._release(seq)
        self.running = [s for s in self.running if s.status == "running"]
        return (np.array([s.seq_id + i for s, i in self._samples], np.int64), sampled.copy(),
                np.array(finish, np.int8))

    def abort_batch(self, batch: ScheduledBatch) -> np.ndarray:
        """Give up on the in-flight batch: finish every sequence it holds; its seq ids."""
        self._check_pending(batch)
        self._inflight = None
        ids = np.array([s.seq_id for s in self._rows], np.int64)
        for seq_id in ids.tolist():
            self.finish(seq_id, FinishReason.ABORTED)
        return ids

    def _check_pending(self, batch: ScheduledBatch) -> None:
        if self._inflight is None or batch is not self._inflight:
            raise ValueError("`batch` must be the batch returned by the last schedule() and "
                             "not yet updated, got a stale or foreign batch")

    def fork(self, seq_id: int, new_seq_id: int, last_token: int) -> None:
        """Beam search: ``Scheduler.fork`` (same checks and errors)."""
        if self._inflight is not None and self._inflight.num_seqs > 0:
            raise ValueError("fork() needs no batch in flight: call update() first")
        p = self.seqs.get(seq_id)
        if p is None or p.status != "running" or p.num_scheduled \
                or p.num_computed != len(p.tokens) - 1:
            raise ValueError(f"`seq_id` must be a running sequence between steps whose last "
                             f"token only is uncomputed, got {seq_id}")
        if new_seq_id in self.seqs:
            raise ValueError(f"`new_seq_id` must be unused, got {new_seq_id}")
        weight = sum(s.num_samples for s in self.running)
        if weight + 1 > self.max_num_seqs:
            raise ValueError(f"fork() needs a free place under max_num_seqs "
                             f"({self.max_num_seqs}), got {weight} running")
        self._clone(p, new_seq_id).tokens[-1] = last_token

    def _fork(self, parent: ReferenceSequence, i: int) -> ReferenceSequence | None:
        """Sibling ``i`` of a group whose prompt completed: a copy after this step that
        shares the parent's blocks; None when the parent finished meanwhile."""
        if parent.status != "running":
            return None
        parent.num_samples -= 1
        return self._clone(parent, parent.seq_id + i)

    def _clone(self, parent: ReferenceSequence, seq_id: int) -> ReferenceSequence:
        """A running copy of ``parent`` after the in-flight step, sharing its blocks."""
        child = ReferenceSequence(
            seq_id, list(parent.tokens), parent.num_prompt_tokens,
            parent.max_tokens, parent.stop_token_ids, 1, "running",
            parent.num_computed + parent.num_scheduled, 0, parent.num_hashed, list(parent.blocks),
            parent.skip_cache, parent.cache_salt)
        self.allocator.fork(child.blocks)
        self.seqs[child.seq_id] = child
        self.running.append(child)
        return child

    def _cache_full_blocks(self, seq: ReferenceSequence) -> None:
        bs = self.block_size
        while self.prefix_cache is not None and (seq.num_hashed + 1) * bs <= seq.num_computed:
            end = (seq.num_hashed + 1) * bs
            self.prefix_cache.register(seq.blocks[seq.num_hashed],
                                       prefix_key(seq.cache_salt, tuple(seq.tokens[:end])))
            seq.num_hashed += 1

    def _release(self, seq: ReferenceSequence) -> None:
        self.allocator.free_blocks(seq.blocks)
        seq.status, seq.num_hashed = "finished", 0
