# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Sequence manager: the sequences, their queues and blocks, and the update/finish side of a step.

:class:`SeqManager` owns the per-sequence C state (a :c:type:`SeqStore`, see sequence.pxd), the
running and waiting queues, the block pool and the in-flight :class:`BatchBuilder`. It applies
a step's results (:meth:`update`: advance, append sampled tokens, fork groups, finish, free),
finishes sequences on request (:meth:`finish`) and answers the Python-facing queries and debug
accessors. It is the base class of :class:`~nybble.runtime.scheduler.Scheduler`, which
constructs it and decides what runs each step (admission, chunking, preemption); it is not
instantiated on its own.
"""
from libc.stdint cimport int8_t, int32_t, int64_t
from libc.string cimport memmove

import numpy as np

from nybble.runtime.block_allocator cimport raise_alloc_error
from nybble.runtime.sequence cimport (FINISH_ABORTED, FINISH_LENGTH, FINISH_NONE,
                                      FINISH_STOPPED, SEQ_RUNNING, SEQ_WAITING, SeqState,
                                      compact_running, seq_table, seq_tokens, store_clone,
                                      store_dealloc, store_new_slot, store_release)

_STATUS_NAMES = {SEQ_WAITING: "waiting", SEQ_RUNNING: "running"}


cdef class SeqManager:
    """Sequences, queues and blocks behind :class:`Scheduler` (base class; see the module
    docstring). Contract: every non-empty batch from ``schedule()`` is passed to
    :meth:`update` before the next ``schedule()``."""

    def __dealloc__(self):
        store_dealloc(&self._st)

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
        for r in range(self._batch._ns):
            i = self._batch._sample_fork[r]
            if i == 0:
                continue
            p = self._batch._sample_slots[r]
            if (self._st.seqs[p].status != SEQ_RUNNING
                    or self._st.seqs[p].seq_id + i != self._batch._sample_seq_ids[r]):
                self._batch._sample_slots[r] = -1   # parent finished meanwhile: no sibling
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
            self._batch._sample_slots[r] = c
        return 0

    # ---- C core (GIL released; errors are negative AllocStatus codes) --------------------------

    cdef int _free_blocks(self, int32_t slot) noexcept nogil:
        """Drop the sequence's reference to each of its blocks, last block first (cached ones
        stay findable until evicted); its prefix-hash state restarts at block 0."""
        self._st.seqs[slot].num_hashed, self._st.seqs[slot].last_hash = 0, 0
        return self._alloc.c_free_table(seq_table(&self._st, slot),
                                        &self._st.seqs[slot].num_blocks)

    cdef void _cache_full_blocks(self, SeqState* s, int32_t slot) noexcept nogil:
        """Prefix caching: register every block of ``s`` that is now full and computed."""
        cdef int32_t bs = self._block_size
        cdef int32_t* table = seq_table(&self._st, slot)
        cdef int32_t* tokens = seq_tokens(&self._st, s)
        while (s.num_hashed + 1) * bs <= s.num_computed:
            s.last_hash = self._alloc._cache.c_register(table[s.num_hashed], s.last_hash,
                                                        tokens + s.num_hashed * bs)
            s.num_hashed += 1

    cdef int _c_update(self, const int32_t[::1] sampled, int64_t[::1] out_ids,
                       int32_t[::1] out_tokens, int8_t[::1] out_finish) noexcept nogil:
        """Advance num_computed of every row, append sampled tokens, finish and free.
        Returns the number of finished sequences or an error code."""
        cdef int32_t b, r, j, slot, tok, finished = 0
        cdef int8_t fin
        cdef int rc
        cdef SeqState* s
        cdef const int32_t* row_slots = self._batch._row_slots       # hoisted out of the loops
        cdef const int32_t* sample_slots = self._batch._sample_slots
        cdef const int64_t* row_ids = &self._batch._seq_ids[0]
        cdef const int64_t* sample_ids = &self._batch._sample_seq_ids[0]
        for b in range(self._batch._nb):
            s = &self._st.seqs[row_slots[b]]
            if s.status == SEQ_RUNNING and s.seq_id == row_ids[b]:
                s.num_computed += s.num_scheduled
                s.num_scheduled = 0
                if self._alloc._caching:
                    self._cache_full_blocks(s, row_slots[b])
        for r in range(self._batch._ns):
            slot, tok = sample_slots[r], sampled[r]
            out_ids[r], out_tokens[r] = sample_ids[r], tok
            if (slot < 0 or self._st.seqs[slot].status != SEQ_RUNNING
                    or self._st.seqs[slot].seq_id != sample_ids[r]):
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
        cdef int32_t S = self._batch._ns
        if arr.ndim != 1 or arr.shape[0] != S:
            raise ValueError(f"`sampled` must have shape ({S},), got {arr.shape}")
        self._inflight = None
        self._fork_groups()
        ids, tokens, finish = np.empty(S, np.int64), np.empty(S, np.int32), np.empty(S, np.int8)
        cdef const int32_t[::1] sv = arr
        cdef int64_t[::1] iv = ids
        cdef int32_t[::1] tv = tokens
        cdef int8_t[::1] fv = finish
        cdef int rc, r
        with nogil:
            rc = self._c_update(sv, iv, tv, fv)
        if rc < 0:
            raise_alloc_error(rc, self._alloc._err_block)
        for r in range(S if rc > 0 else 0):
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
    def num_prefix_hit_tokens(self) -> int:
        """Tokens found in the prefix cache when sequences were admitted (total)."""
        return self._prefix_hits

    @property
    def num_prefix_query_tokens(self) -> int:
        """Tokens of the sequences admitted while prefix caching is on (total; 0 when off)."""
        return self._prefix_queries

    @property
    def prefix_cache(self):
        """The pool's PrefixCache (``match``, ``debug_state``); None when caching is off."""
        return self._alloc._cache

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks in the pool (parked prefix-cache blocks count as free)."""
        return self._alloc.c_num_available()

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
