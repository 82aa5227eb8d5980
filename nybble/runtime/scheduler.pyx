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
   budget, cap and free blocks allow. A prompt longer than the remaining budget is chunked when
   ``enable_chunked_prefill``; otherwise it waits until it fits whole, except a prompt longer
   than the whole budget, which is chunked anyway (it could never fit, and refusing it would
   deadlock recompute after preemption).

A sequence is sampled in a step iff after the step ``num_computed == num_tokens``. Prefill,
chunked prefill, decode and recompute after preemption (prompt + generated tokens become the
prefill) all fall out of this one rule. Token regions of one sequence at schedule time::

    |<---------------------- num_tokens (prompt + generated) ---------------------->|
    |<------ num_computed (KV cached) ------>|<--- new (scheduled) --->|<-- later -->|
    |  blk 0  |  blk 1  | ... | blk k (part) |   to-allocate blocks    |
                                  ^ first write lands in blk k: if its ref count > 1
                                    (shared with a sibling) it is copied first (CoW)
    blocks to allocate = ceil((num_computed + new) / block_size) - num_blocks

A request whose ``min(prompt + max_tokens, max_model_len)`` tokens need more blocks than the
pool holds is rejected in :meth:`Scheduler.add` (KVCacheExhaustedError), so the oldest running
sequence always fits alone and the scheduler never deadlocks. Contract: every non-empty batch
from :meth:`schedule` is passed to :meth:`update` before the next :meth:`schedule`.
"""
from cpython.mem cimport PyMem_Free
from libc.stdint cimport int8_t, int32_t, int64_t
from libc.string cimport memcpy, memmove, memset

import numpy as np

from nybble.errors import KVCacheExhaustedError
from nybble.runtime.batch import ScheduledBatch

from nybble.runtime.block_allocator cimport (ALLOC_COPIED, ALLOC_NO_SPACE, BlockAllocator,
                                             raise_alloc_error)
from nybble.runtime.sequence cimport (FINISH_ABORTED, FINISH_LENGTH, FINISH_NONE,
                                      FINISH_STOPPED, SEQ_RUNNING, SEQ_WAITING, SeqState,
                                      cdiv, compact_running, grow_buffer, seq_table, seq_tokens,
                                      store_clone, store_dealloc, store_grow, store_new_slot,
                                      store_release)

cdef enum:
    NO_BLOCKS = 1   # _allocate_for: the pool is short (capacity, not an error)

_STATUS_NAMES = {SEQ_WAITING: "waiting", SEQ_RUNNING: "running"}


cdef class Scheduler:
    """Continuous-batching scheduler (see the module docstring for the rule).

    Args:
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        max_num_seqs: cap on running sequences (a group counts ``num_samples``).
        max_num_batched_tokens: token budget per step (tokens).
        max_model_len: context limit (tokens).
        enable_chunked_prefill: split prompts across steps to fill the budget.

    Raises:
        ValueError: a size is below 1.
    """

    def __init__(self, int num_blocks, int block_size, int max_num_seqs,
                 int max_num_batched_tokens, int max_model_len,
                 bint enable_chunked_prefill=True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
        self._alloc = BlockAllocator(num_blocks, block_size)
        self._block_size = block_size
        self._max_num_seqs = max_num_seqs
        self._max_batched = max_num_batched_tokens
        self._max_model_len = max_model_len
        self._max_blocks_per_seq = cdiv(max_model_len, block_size)
        self._chunked = enable_chunked_prefill
        self._slot_of = {}
        self._st.max_blocks = self._max_blocks_per_seq
        store_grow(&self._st)
        cdef size_t rows = max_num_seqs * sizeof(int32_t)
        self._row_slots = <int32_t*> grow_buffer(NULL, rows)
        self._row_table_len = <int32_t*> grow_buffer(NULL, rows)
        self._sample_slots = <int32_t*> grow_buffer(NULL, rows)
        self._sample_fork = <int32_t*> grow_buffer(NULL, rows)
        memset(self._row_table_len, 0, rows)
        R, T, MB = max_num_seqs, max_num_batched_tokens, self._max_blocks_per_seq
        # Preallocated once; the step loop only writes into them (llama2.c's RunState).
        self._input_ids = self._np_input_ids = np.zeros(T, np.int32)
        self._positions = self._np_positions = np.zeros(T, np.int64)
        self._slot_mapping = self._np_slot_mapping = np.zeros(T, np.int64)
        self._block_tables = self._np_block_tables = np.full((R, MB), -1, np.int32)
        self._seq_lens = self._np_seq_lens = np.zeros(R, np.int32)
        self._qsl = self._np_qsl = np.zeros(R + 1, np.int32)
        self._seq_ids = self._np_seq_ids = np.zeros(R, np.int64)
        self._sample_rows = self._np_sample_rows = np.zeros(R, np.int32)
        self._sample_seq_ids = self._np_sample_seq_ids = np.zeros(R, np.int64)
        self._copy_src = self._np_copy_src = np.zeros(R, np.int32)
        self._copy_dst = self._np_copy_dst = np.zeros(R, np.int32)

    def __dealloc__(self):
        store_dealloc(&self._st)
        PyMem_Free(self._row_slots)
        PyMem_Free(self._row_table_len)
        PyMem_Free(self._sample_slots)
        PyMem_Free(self._sample_fork)

    # ---- storage (GIL held) ------------------------------------------------------------------

    cdef int32_t _new_slot(self, int64_t seq_id, int64_t num_stop, int64_t cap) except -1:
        """Take a slot for ``seq_id`` (status WAITING) and register it in ``_slot_of``."""
        cdef int32_t slot = store_new_slot(&self._st, seq_id, num_stop, cap)
        self._slot_of[seq_id] = slot
        return slot

    cdef int _fork_groups(self) except -1:
        """Create the siblings of every group whose prompt completes in the in-flight batch."""
        cdef int32_t r, i, p, c
        cdef SeqState* ps
        cdef SeqState* cs
        for r in range(self._ns):
            i = self._sample_fork[r]
            if i == 0:
                continue
            p = self._sample_slots[r]
            if (self._st.seqs[p].status != SEQ_RUNNING
                    or self._st.seqs[p].seq_id + i != self._sample_seq_ids[r]):
                self._sample_slots[r] = -1   # parent finished meanwhile: no sibling
                continue
            c = self._new_slot(self._st.seqs[p].seq_id + i, self._st.seqs[p].num_stop,
                               self._st.seqs[p].cap_tokens)
            store_clone(&self._st, p, c)
            ps, cs = &self._st.seqs[p], &self._st.seqs[c]   # after _new_slot: it may realloc
            raise_alloc_error(self._alloc.c_fork_table(seq_table(&self._st, p),
                                                       seq_table(&self._st, c), ps.num_blocks),
                              self._alloc._err_block)
            cs.num_blocks, cs.status = ps.num_blocks, SEQ_RUNNING
            self._st.running[self._num_running] = c
            self._num_running += 1
            ps.num_samples -= 1          # its share of the group's seq-cap weight moves to c
            self._sample_slots[r] = c
        return 0

    # ---- C core (GIL released; errors are negative AllocStatus codes) --------------------------

    cdef int _free_blocks(self, int32_t slot) noexcept nogil:
        """Drop the sequence's reference to each of its blocks, last block first."""
        return self._alloc.c_free_table(seq_table(&self._st, slot),
                                        &self._st.seqs[slot].num_blocks)

    cdef int _allocate_for(self, int32_t slot, int32_t n) noexcept nogil:
        """Cover ``n`` new tokens of ``slot`` with blocks (copy-on-write for a shared partial
        block). Returns 0, NO_BLOCKS (nothing changed) or an error code."""
        cdef SeqState* s = &self._st.seqs[slot]
        cdef int rc = self._alloc.c_cover(seq_table(&self._st, slot), &s.num_blocks,
                                          s.num_computed, s.num_computed + n,
                                          &self._copy_src[self._nc], &self._copy_dst[self._nc])
        if rc == ALLOC_COPIED:
            self._nc += 1
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

    cdef int _schedule_running(self, int32_t* budget) noexcept nogil:
        """Step 1: running sequences, oldest first. Returns preemptions (>= 0) or an error."""
        cdef int32_t i = 0, slot, victim, n, preempted = 0
        cdef int rc
        cdef SeqState* s
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
            self._row_slots[self._nb] = slot
            self._nb += 1
            budget[0] -= n
            i += 1
        return preempted

    cdef int _schedule_waiting(self, int32_t* budget) noexcept nogil:
        """Step 2: admit waiting sequences FCFS (head-of-line). Returns 0 or an error."""
        cdef int32_t k = 0, slot, n
        cdef int rc = 0
        cdef SeqState* s
        while k < self._num_waiting and budget[0] > 0:
            slot = self._st.waiting[k]
            s = &self._st.seqs[slot]
            if self._running_weight + s.num_samples > self._max_num_seqs:
                break
            n = s.num_tokens - s.num_computed
            if n > budget[0]:
                if not self._chunked and n <= self._max_batched:
                    break           # would fit whole in a later step
                n = budget[0]
            rc = self._allocate_for(slot, n)
            if rc != 0:
                break
            s.status, s.num_scheduled = SEQ_RUNNING, n
            self._st.running[self._num_running] = slot
            self._num_running += 1
            self._running_weight += s.num_samples
            self._row_slots[self._nb] = slot
            self._nb += 1
            budget[0] -= n
            k += 1
        self._num_waiting -= k
        memmove(self._st.waiting, self._st.waiting + k, self._num_waiting * sizeof(int32_t))
        return rc if rc < 0 else 0

    cdef void _build_batch(self) noexcept nogil:
        """Step 3: fill the output buffers for the rows in ``_row_slots``."""
        cdef int32_t b, j, i, n, start, pos, slot, t = 0, bs = self._block_size
        cdef int32_t MB = self._max_blocks_per_seq
        cdef int32_t* table
        cdef int32_t* tokens
        cdef int32_t* row
        cdef SeqState* s
        self._ns, self._max_q, self._max_sl = 0, 0, 0
        self._qsl[0] = 0
        for b in range(self._nb):
            slot = self._row_slots[b]
            s = &self._st.seqs[slot]
            n, start = s.num_scheduled, s.num_computed
            tokens = seq_tokens(&self._st, s)
            table = seq_table(&self._st, slot)
            for j in range(n):
                pos = start + j
                self._input_ids[t] = tokens[pos]
                self._positions[t] = pos
                self._slot_mapping[t] = <int64_t> table[pos // bs] * bs + pos % bs
                t += 1
            self._qsl[b + 1] = t
            self._seq_lens[b] = start + n
            self._seq_ids[b] = s.seq_id
            row = &self._block_tables[b, 0]
            memcpy(row, table, s.num_blocks * sizeof(int32_t))
            for j in range(s.num_blocks, self._row_table_len[b]):
                row[j] = -1         # clear what the previous occupant of this row left
            self._row_table_len[b] = s.num_blocks
            self._max_q = max(self._max_q, n)
            self._max_sl = max(self._max_sl, start + n)
            if start + n == s.num_tokens:
                for i in range(s.num_samples):
                    self._sample_rows[self._ns] = t - 1
                    self._sample_seq_ids[self._ns] = s.seq_id + i
                    self._sample_slots[self._ns] = slot
                    self._sample_fork[self._ns] = i
                    self._ns += 1
        self._nt = t

    cdef int _c_update(self, const int32_t[::1] sampled, int64_t[::1] out_ids,
                       int32_t[::1] out_tokens, int8_t[::1] out_finish) noexcept nogil:
        """Advance num_computed of every row, append sampled tokens, finish and free.
        Returns the number of finished sequences or an error code."""
        cdef int32_t b, r, j, slot, tok, finished = 0
        cdef int8_t fin
        cdef int rc
        cdef SeqState* s
        for b in range(self._nb):
            s = &self._st.seqs[self._row_slots[b]]
            if s.status == SEQ_RUNNING and s.seq_id == self._seq_ids[b]:
                s.num_computed += s.num_scheduled
                s.num_scheduled = 0
        for r in range(self._ns):
            slot, tok = self._sample_slots[r], sampled[r]
            out_ids[r], out_tokens[r] = self._sample_seq_ids[r], tok
            if (slot < 0 or self._st.seqs[slot].status != SEQ_RUNNING
                    or self._st.seqs[slot].seq_id != self._sample_seq_ids[r]):
                out_finish[r] = FINISH_ABORTED   # finished while its batch was in flight
                continue
            s = &self._st.seqs[slot]
            seq_tokens(&self._st, s)[s.num_tokens] = tok
            s.num_tokens += 1
            fin = FINISH_NONE
            for j in range(s.num_stop):
                if self._st.arena[s.region_off + j] == tok:
                    fin = FINISH_STOPPED
                    break
            if fin == FINISH_NONE and (s.num_tokens - s.num_prompt_tokens >= s.max_tokens
                                       or s.num_tokens >= self._max_model_len):
                fin = FINISH_LENGTH
            out_finish[r] = fin
            if fin != FINISH_NONE:
                rc = self._free_blocks(slot)
                if rc != 0:
                    return rc
                self._running_weight -= s.num_samples
                store_release(&self._st, slot)
                finished += 1
        if finished:
            self._num_running = compact_running(&self._st, self._num_running)
        return finished

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
            self._nb, self._nc = 0, 0
            rc = self._schedule_running(&budget)
            if rc == 0:
                rc = self._schedule_waiting(&budget)
            if rc >= 0:
                self._build_batch()
        if rc < 0:
            raise_alloc_error(rc, self._alloc._err_block)
        B, T, S, C = self._nb, self._nt, self._ns, self._nc
        self._inflight = ScheduledBatch(
            num_seqs=B, num_tokens=T, max_query_len=self._max_q, max_seq_len=self._max_sl,
            input_ids=self._np_input_ids[:T], positions=self._np_positions[:T],
            slot_mapping=self._np_slot_mapping[:T], block_tables=self._np_block_tables[:B],
            seq_lens=self._np_seq_lens[:B], query_start_loc=self._np_qsl[:B + 1],
            seq_ids=self._np_seq_ids[:B], sample_rows=self._np_sample_rows[:S],
            sample_seq_ids=self._np_sample_seq_ids[:S], copy_src=self._np_copy_src[:C],
            copy_dst=self._np_copy_dst[:C])
        return self._inflight

    def update(self, batch, sampled):
        """Apply one step's results: advance num_computed of every row, append each sampled
        token, fork groups, finish (stop id -> 1, max_tokens / max_model_len -> 2) and free.

        Args:
            batch: the ScheduledBatch returned by the last ``schedule()``.
            sampled: int32[S] token ids, one per ``batch.sample_rows`` entry.

        Returns:
            (seq_ids int64[S], tokens int32[S], finish int8[S]); finish 3 marks a row whose
            sequence was finished (finish()) while the batch was in flight.

        Raises:
            ValueError: ``batch`` is not the pending batch, or ``sampled`` has the wrong shape.
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        if self._inflight is None or batch is not self._inflight:
            raise ValueError("`batch` must be the batch returned by the last schedule() and "
                             "not yet updated, got a stale or foreign batch")
        arr = np.ascontiguousarray(sampled, dtype=np.int32)
        if arr.ndim != 1 or arr.shape[0] != self._ns:
            raise ValueError(f"`sampled` must have shape ({self._ns},), got {arr.shape}")
        self._inflight = None
        self._fork_groups()
        ids, tokens, finish = (np.empty(self._ns, np.int64), np.empty(self._ns, np.int32),
                               np.empty(self._ns, np.int8))
        cdef const int32_t[::1] sv = arr
        cdef int64_t[::1] iv = ids
        cdef int32_t[::1] tv = tokens
        cdef int8_t[::1] fv = finish
        cdef int rc, r
        with nogil:
            rc = self._c_update(sv, iv, tv, fv)
        if rc < 0:
            raise_alloc_error(rc, self._alloc._err_block)
        for r in range(self._ns if rc > 0 else 0):
            if fv[r] == FINISH_STOPPED or fv[r] == FINISH_LENGTH:
                del self._slot_of[iv[r]]
        return ids, tokens, finish

    def finish(self, int64_t seq_id, int reason) -> None:
        """Finish ``seq_id`` now (1 stop string, 2 length, 3 aborted) and free its blocks.
        No-op when the id is unknown or already finished; an unforked group goes as a whole.

        Raises:
            ValueError: ``reason`` is not 1, 2 or 3.
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        if reason not in (FINISH_STOPPED, FINISH_LENGTH, FINISH_ABORTED):
            raise ValueError(f"`reason` must be 1, 2 or 3, got {reason}")
        slot_obj = self._slot_of.pop(seq_id, None)
        if slot_obj is None:
            return
        cdef int32_t slot = slot_obj, i = 0
        cdef int32_t* queue = self._st.waiting
        cdef int32_t* count = &self._num_waiting
        if self._st.seqs[slot].status == SEQ_RUNNING:
            queue, count = self._st.running, &self._num_running
            self._running_weight -= self._st.seqs[slot].num_samples
        while queue[i] != slot:
            i += 1
        count[0] -= 1
        memmove(queue + i, queue + i + 1, (count[0] - i) * sizeof(int32_t))
        raise_alloc_error(self._free_blocks(slot), self._alloc._err_block)
        store_release(&self._st, slot)

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return self._num_running + self._num_waiting > 0

    @property
    def num_running(self) -> int:
        """Sequences in the running list (an unforked group is one entry)."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        """Sequences in the waiting queue (new and preempted)."""
        return self._num_waiting

    @property
    def num_preemptions(self) -> int:
        """Preemptions since construction."""
        return self._num_preemptions

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks in the pool."""
        return self._alloc._num_free

    @property
    def num_blocks(self) -> int:
        """KV blocks in the pool."""
        return self._alloc._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._block_size

    def seq_block_ids(self, int64_t seq_id):
        """Copy of the block table of ``seq_id`` (int32[num_blocks]).

        Raises:
            KeyError: ``seq_id`` is not waiting or running.
        """
        if seq_id not in self._slot_of:
            raise KeyError(f"`seq_id` must be a waiting or running sequence, got {seq_id}")
        cdef int32_t slot = self._slot_of[seq_id]
        cdef int32_t* table = seq_table(&self._st, slot)
        return np.array([table[k] for k in range(self._st.seqs[slot].num_blocks)], np.int32)

    def debug_state(self) -> dict:
        """Allocator state (``ref_counts``, ``free_list``) plus ``seqs`` (seq_id -> dict of
        status, token counts, ``block_ids`` and ``token_ids``), ``running`` and ``waiting``
        (seq ids in queue order) and ``running_weight``, for tests."""
        state = self._alloc.debug_state()
        seqs = {}
        cdef SeqState* s
        for seq_id, slot in self._slot_of.items():
            s = &self._st.seqs[<int32_t> slot]
            tok = seq_tokens(&self._st, s)
            seqs[seq_id] = {
                "status": _STATUS_NAMES[s.status], "num_prompt_tokens": s.num_prompt_tokens,
                "num_tokens": s.num_tokens, "num_computed": s.num_computed,
                "max_tokens": s.max_tokens, "num_samples": s.num_samples,
                "block_ids": self.seq_block_ids(seq_id),
                "token_ids": np.array([tok[k] for k in range(s.num_tokens)], dtype=np.int32)}
        state.update(
            seqs=seqs, running_weight=self._running_weight,
            running=[self._st.seqs[self._st.running[k]].seq_id for k in range(self._num_running)],
            waiting=[self._st.seqs[self._st.waiting[k]].seq_id for k in range(self._num_waiting)])
        return state
