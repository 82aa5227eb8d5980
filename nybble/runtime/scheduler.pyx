# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Continuous-batching scheduler over a paged KV pool (typed Cython, no torch).

Scheduling rule (vLLM V1, no prefill/decode phases): every sequence tracks ``num_computed``
toward ``num_tokens`` (prompt + generated). Each step, under one token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``, a not-yet-forked
parallel-sampling group counts ``num_samples``):

1. running sequences, oldest first, each get ``min(num_tokens - num_computed, budget)`` tokens;
   when the pool cannot cover them, the most recently admitted running sequence is preempted
   (blocks freed, ``num_computed = 0``, front of the waiting queue; possibly the sequence
   itself) and the allocation is retried;
2. if nobody was preempted, waiting sequences are admitted FCFS (strict head-of-line) while
   budget, cap and free blocks allow; with prefix caching, an admitted sequence first takes
   its longest cached chain of full blocks (at most ``num_tokens - 1`` tokens, so the last
   token is computed and sampled) and starts with ``num_computed`` = the hit tokens. A prompt
   longer than the remaining budget is chunked when ``enable_chunked_prefill``; otherwise it
   waits until it fits whole, except a prompt longer than the whole budget, which is chunked
   anyway (it could never fit, and refusing it would deadlock recompute after preemption).

A sequence is sampled in a step iff after the step ``num_computed == num_tokens``. Prefill,
chunked prefill, decode and recompute after preemption (prompt + generated tokens become the
prefill) all fall out of this one rule. Token regions of one sequence at schedule time::

    |<---------------------- num_tokens (prompt + generated) ---------------------->|
    |<------ num_computed (KV cached) ------>|<--- new (scheduled) --->|<-- later -->|
    |<-- prefix hit -->|  (whole cached blocks, taken on admission: num_computed starts here)
    |  blk 0  |  blk 1  | ... | blk k (part) |   to-allocate blocks    |
                                  ^ first write lands in blk k: if its ref count > 1
                                    (shared with a sibling) it is copied first (CoW)
    blocks to allocate = ceil((num_computed + new) / block_size) - num_blocks

Hit blocks are whole (``num_computed = h * block_size`` on admission), so no write ever lands
in a cached block; blocks become cacheable in ``update`` once full and computed.

A request whose ``min(prompt + max_tokens, max_model_len)`` tokens need more blocks than the
pool holds is rejected in :meth:`Scheduler.add` (KVCacheExhaustedError), so the oldest running
sequence always fits alone and the scheduler never deadlocks. Contract: every non-empty batch
from :meth:`schedule` is passed to :meth:`update` before the next :meth:`schedule`.

Layout: this module decides what runs (admission, chunking, preemption) and builds the step;
its base class :class:`~nybble.runtime.seq_manager.SeqManager` owns the sequences, queues and
blocks, applies a step's results (``update``/``finish``) and answers the queries;
:class:`~nybble.runtime.batch_builder.BatchBuilder` owns and fills the output buffers.
"""
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy, memmove

import numpy as np

from nybble.errors import KVCacheExhaustedError
from nybble.runtime.batch import ScheduledBatch

from nybble.runtime.batch_builder cimport BatchBuilder
from nybble.runtime.block_allocator cimport (ALLOC_COPIED, ALLOC_NO_SPACE, BlockAllocator,
                                             raise_alloc_error)
from nybble.runtime.seq_manager cimport SeqManager
from nybble.runtime.sequence cimport (SEQ_RUNNING, SEQ_WAITING, SeqState, cdiv, seq_table,
                                      seq_tokens, store_grow)

cdef enum:
    NO_BLOCKS = 1   # _allocate_for: the pool is short (capacity, not an error)


cdef class Scheduler(SeqManager):
    """Continuous-batching scheduler (see the module docstring for the rule).

    Args:
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        max_num_seqs: cap on running sequences (a group counts ``num_samples``).
        max_num_batched_tokens: token budget per step (tokens).
        max_model_len: context limit (tokens).
        enable_chunked_prefill: split prompts across steps to fill the budget.
        enable_prefix_caching: reuse cached full blocks of earlier sequences on admission
            (automatic prefix caching, see prefix_cache.pyx).

    Raises:
        ValueError: a size is below 1.
    """

    def __init__(self, int num_blocks, int block_size, int max_num_seqs,
                 int max_num_batched_tokens, int max_model_len,
                 bint enable_chunked_prefill=True, bint enable_prefix_caching=False):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
        self._alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self._max_batched = max_num_batched_tokens
        self._max_model_len = max_model_len
        self._max_blocks_per_seq = cdiv(max_model_len, block_size)
        self._chunked = enable_chunked_prefill
        self._slot_of = {}
        self._st.max_blocks = self._max_blocks_per_seq
        store_grow(&self._st)
        self._batch = BatchBuilder(max_num_seqs, max_num_batched_tokens,
                                   self._max_blocks_per_seq, block_size)

    # ---- C core: admission and preemption (GIL released; errors are negative AllocStatus
    # codes) ----------------------------------------------------------------------------------

    cdef int _allocate_for(self, int32_t slot, int32_t n) noexcept nogil:
        """Cover ``n`` new tokens of ``slot`` with blocks (copy-on-write for a shared partial
        block). Returns 0, NO_BLOCKS (nothing changed) or an error code."""
        cdef SeqState* s = &self._st.seqs[slot]
        cdef int32_t nc = self._batch._nc
        cdef int rc = self._alloc.c_cover(seq_table(&self._st, slot), &s.num_blocks,
                                          s.num_computed, s.num_computed + n,
                                          &self._batch._copy_src[nc], &self._batch._copy_dst[nc])
        if rc == ALLOC_COPIED:
            self._batch._nc += 1
        return NO_BLOCKS if rc == ALLOC_NO_SPACE else min(rc, 0)

    cdef int _preempt_last(self) noexcept nogil:
        """Preempt the most recently admitted running sequence to the front of waiting."""
        self._num_running -= 1
        cdef int32_t slot = self._st.running[self._num_running]
        cdef SeqState* s = &self._st.seqs[slot]
        self._running_weight -= s.num_samples
        cdef int rc = self._free_blocks(slot)
        if rc != 0:
            return rc
        s.num_computed, s.num_scheduled, s.status = 0, 0, SEQ_WAITING
        memmove(self._st.waiting + 1, self._st.waiting, self._num_waiting * sizeof(int32_t))
        self._st.waiting[0] = slot
        self._num_waiting += 1
        self._num_preemptions += 1
        return 0

    cdef int _reuse_prefix(self, int32_t slot) noexcept nogil:
        """Admission with prefix caching: point the table of waiting ``slot`` (no blocks) at
        its longest cached chain of full blocks, at most ``num_tokens - 1`` tokens, taking a
        reference to each; ``num_computed`` = the hit tokens. Returns them or an error code."""
        cdef SeqState* s = &self._st.seqs[slot]
        cdef int32_t* table = seq_table(&self._st, slot)
        cdef int32_t j, k = self._alloc._cache.c_match(
            seq_tokens(&self._st, s), (s.num_tokens - 1) // self._block_size, table,
            &s.last_hash)
        cdef int rc
        for j in range(k):
            rc = self._alloc.c_incref(table[j])
            if rc != 0:
                s.num_blocks = j
                return rc
        s.num_blocks = s.num_hashed = k
        s.num_computed = k * self._block_size
        return s.num_computed

    cdef int _schedule_running(self, int32_t* budget) noexcept nogil:
        """Step 1: running sequences, oldest first. Returns preemptions (>= 0) or an error."""
        cdef int32_t i = 0, slot, victim, n, preempted = 0
        cdef int rc
        cdef SeqState* s
        cdef int32_t* rows = self._batch._row_slots
        while i < self._num_running and budget[0] > 0:
            slot = self._st.running[i]
            s = &self._st.seqs[slot]
            n = min(s.num_tokens - s.num_computed, budget[0])
            victim = -1
            rc = self._allocate_for(slot, n)
            while rc == NO_BLOCKS:
                victim = self._st.running[self._num_running - 1]
                rc = self._preempt_last()
                preempted += 1
                if rc != 0 or victim == slot:
                    break
                rc = self._allocate_for(slot, n)
            if rc < 0:
                return rc
            if victim == slot:      # preempted itself: everything after it is gone too
                break
            s.num_scheduled = n
            rows[self._batch._nb] = slot
            self._batch._nb += 1
            budget[0] -= n
            i += 1
        return preempted

    cdef int _schedule_waiting(self, int32_t* budget) noexcept nogil:
        """Step 2: admit waiting sequences FCFS (head-of-line). Returns 0 or an error."""
        cdef int32_t k = 0, slot, n, hit
        cdef int rc = 0
        cdef SeqState* s
        cdef int32_t* rows = self._batch._row_slots
        while k < self._num_waiting and budget[0] > 0:
            slot = self._st.waiting[k]
            s = &self._st.seqs[slot]
            if self._running_weight + s.num_samples > self._max_num_seqs:
                break
            hit = self._reuse_prefix(slot) if self._alloc._caching else 0
            if hit < 0:
                rc = hit
                break
            n, rc = s.num_tokens - s.num_computed, 0
            if n > budget[0]:
                if not self._chunked and n <= self._max_batched:
                    rc = NO_BLOCKS  # would fit whole in a later step
                n = budget[0]
            if rc == 0:
                rc = self._allocate_for(slot, n)
            if rc != 0:
                if rc > 0 and s.num_blocks > 0:     # not admitted: give the hits back
                    rc = self._free_blocks(slot)
                    s.num_computed = 0
                break
            if self._alloc._caching:
                self._prefix_hits += hit
                self._prefix_queries += s.num_tokens
            s.status, s.num_scheduled = SEQ_RUNNING, n
            self._st.running[self._num_running] = slot
            self._num_running += 1
            self._running_weight += s.num_samples
            rows[self._batch._nb] = slot
            self._batch._nb += 1
            budget[0] -= n
            k += 1
        self._num_waiting -= k
        memmove(self._st.waiting, self._st.waiting + k, self._num_waiting * sizeof(int32_t))
        return rc if rc < 0 else 0

    # ---- Python face -------------------------------------------------------------------------

    def add(self, int64_t seq_id, token_ids, int64_t max_tokens, stop_token_ids=(),
            int num_samples=1) -> None:
        """Queue a request (FCFS) under ``seq_id`` (a group owns seq_id .. seq_id+num_samples-1).

        Args:
            seq_id: engine-chosen id (>= 0, unused).
            token_ids: 1-D prompt token ids (tokens).
            max_tokens: generation budget (>= 1 tokens; generated tokens count after preemption).
            stop_token_ids: 1-D ids that finish the sequence (reason 1) when sampled.
            num_samples: parallel samples sharing the prompt's blocks (1..max_num_seqs).

        Raises:
            ValueError: empty prompt, prompt > max_model_len, bad max_tokens / num_samples /
                seq_id, or an id already in use.
            KVCacheExhaustedError: ``min(prompt + max_tokens, max_model_len)`` tokens need more
                blocks than the whole pool.
        """
        prompt = np.ascontiguousarray(token_ids, dtype=np.int32)
        stops = np.ascontiguousarray(stop_token_ids, dtype=np.int32).reshape(-1)
        cdef int64_t P = prompt.shape[0] if prompt.ndim == 1 else 0, L = self._max_model_len
        if P < 1 or prompt.ndim != 1:
            raise ValueError(f"`token_ids` must be a non-empty 1-D sequence, got shape "
                             f"{prompt.shape}")
        if P > L:
            raise ValueError(f"`token_ids` must have <= max_model_len={L} tokens, got {P}")
        if max_tokens < 1:
            raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}")
        if not 1 <= num_samples <= self._max_num_seqs:
            raise ValueError(f"`num_samples` must be in [1, {self._max_num_seqs}] "
                             f"(max_num_seqs), got {num_samples}")
        if seq_id < 0:
            raise ValueError(f"`seq_id` must be >= 0, got {seq_id}")
        for i in range(num_samples):
            if seq_id + i in self._slot_of:
                raise ValueError(f"`seq_id` must not be in use, got {seq_id + i}")
        cdef int64_t total = min(P + max_tokens, L)
        cdef int64_t need = cdiv(<int32_t> total, self._block_size)
        if need > self._alloc._num_blocks:
            raise KVCacheExhaustedError(
                f"request {seq_id} needs {need} KV blocks (min(prompt {P} + max_tokens "
                f"{max_tokens}, max_model_len {L}) = {total} tokens at {self._block_size} per "
                f"block), but the pool holds only {self._alloc._num_blocks} blocks",
                param="max_tokens")
        cdef int64_t cap = max(total, P + 1)
        cdef int32_t slot = self._new_slot(seq_id, stops.shape[0], cap)
        cdef SeqState* s = &self._st.seqs[slot]
        s.num_prompt_tokens = s.num_tokens = <int32_t> P
        s.max_tokens, s.num_samples = <int32_t> min(max_tokens, cap), num_samples
        cdef const int32_t[::1] pv = prompt
        cdef const int32_t[::1] sv = stops
        if s.num_stop:
            memcpy(self._st.arena + s.region_off, &sv[0], s.num_stop * sizeof(int32_t))
        memcpy(seq_tokens(&self._st, s), &pv[0], P * sizeof(int32_t))
        self._st.waiting[self._num_waiting] = slot
        self._num_waiting += 1

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work and fill the output buffers (see the module docstring).

        Returns:
            ScheduledBatch of numpy views, valid until the next ``schedule()``; ``num_seqs == 0``
            when there is nothing to run.

        Raises:
            RuntimeError: the previous non-empty batch was not passed to ``update()``, or the
                block bookkeeping is corrupt (a bug).
        """
        if self._inflight is not None and self._inflight.num_seqs > 0:
            raise RuntimeError("schedule() called before update() of the previous batch; "
                               "every non-empty batch must be passed to update() first")
        cdef int32_t budget = self._max_batched
        cdef int rc
        with nogil:
            self._batch._nb, self._batch._nc = 0, 0
            rc = self._schedule_running(&budget)
            if rc == 0:
                rc = self._schedule_waiting(&budget)
            if rc >= 0:
                self._batch.build(&self._st)
        if rc < 0:
            raise_alloc_error(rc, self._alloc._err_block)
        self._inflight = self._batch.view()
        return self._inflight
