# cython: language_level=3
"""The sequence table: the scheduler's sequences, their queues, and every change of their state.

:class:`SequenceTable` owns the per-sequence C state (a :c:type:`SlotStore`, see
sequence.pxd), the waiting and running queues and the seq_id -> slot map, and holds the
:class:`BlockAllocator` its sequences' blocks come from. It carries out what the
:class:`~nybble.runtime.scheduler.scheduler.Scheduler` decides (vLLM keeps the same split
between its ``Scheduler`` and its ``Request`` / request-queue objects):

* ``add``: a new sequence at the back of the waiting queue;
* ``take_cached_prefix`` + ``admit`` + ``pop_waiting``: admission (running queue, back);
* ``preempt_last``: the newest running sequence loses its blocks and goes to the front of
  the waiting queue (recomputed later);
* ``apply_step``: one step's results -- forked siblings of parallel-sampling groups, advanced
  ``num_computed`` (newly full blocks enter the prefix cache), appended sampled tokens,
  finished sequences freed in the same step;
* ``finish``: a sequence ends early (stop string, abort) wherever it is.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint64_t
from libc.string cimport memcpy, memmove

import numpy as np

from nybble.runtime.scheduler.block_allocator cimport raise_alloc_error
from nybble.runtime.scheduler.sequence cimport (FinishReason, SEQ_RUNNING, SEQ_WAITING, SeqState,
                                                SlotStore, append_token, block_table_row, cdiv,
                                                seq_tokens, store_clone, store_dealloc,
                                                store_grow, store_new_slot, store_release)

_STATUS_NAMES = {SEQ_WAITING: "waiting", SEQ_RUNNING: "running"}


cdef class SequenceTable:
    """The scheduler's sequences and queues (see the module docstring and the pxd).

    Args:
        allocator: the KV block pool.
        max_model_len: context limit L (tokens).
        max_blocks_per_seq: block-table width ceil(L / block_size) (blocks).
    """

    def __cinit__(self, BlockAllocator allocator, int max_model_len, int max_blocks_per_seq):
        self._allocator = allocator
        self._max_model_len = max_model_len
        self._slot_of = {}
        self.st.max_blocks = max_blocks_per_seq
        store_grow(&self.st)

    def __dealloc__(self):
        store_dealloc(&self.st)

    # ---- GIL held ----------------------------------------------------------------------------

    cdef int32_t add(self, int64_t seq_id, const int32_t[::1] prompt, const int32_t[::1] stops,
                     int64_t max_tokens, int32_t num_samples, int64_t cap_tokens,
                     bint skip_cache=False, uint64_t hash_root=0) except -1:
        """Queue a new sequence at the back of waiting: ``prompt`` (P >= 1 tokens, ``cap_tokens``
        >= P + 1 capacity), ``stops``, ``min(max_tokens, cap_tokens)``, ``num_samples``;
        ``skip_cache``: it never takes cached prefix blocks; ``hash_root``: the root of its
        prefix-hash chain (0; a LoRA adapter's own root). The caller validated every
        argument. Returns its slot."""
        cdef int32_t slot = store_new_slot(&self.st, seq_id, stops.shape[0], cap_tokens)
        self._slot_of[seq_id] = slot
        cdef SeqState* s = &self.st.seqs[slot]
        s.num_prompt_tokens = s.num_tokens = <int32_t> prompt.shape[0]
        s.max_tokens, s.num_samples = <int32_t> min(max_tokens, cap_tokens), num_samples
        s.skip_cache = skip_cache
        s.hash_root = s.last_hash = hash_root
        if s.num_stop:
            memcpy(self.st.arena + s.region_off, &stops[0], s.num_stop * sizeof(int32_t))
        memcpy(seq_tokens(&self.st, s), &prompt[0], s.num_tokens * sizeof(int32_t))
        self.st.waiting[self.num_waiting] = slot
        self.num_waiting += 1
        return slot

    cdef int32_t find(self, int64_t seq_id):
        """Slot of a waiting or running ``seq_id``; -1 when unknown."""
        return self._slot_of.get(seq_id, -1)

    cdef int apply_step(self, BatchBuilder batch, const int32_t[::1] sampled,
                        int64_t[::1] out_ids, int32_t[::1] out_tokens,
                        int8_t[::1] out_finish) except -1:
        """Apply the in-flight ``batch``'s results, ``sampled[r]`` for its sample row r: fork
        groups, then advance and append (see :meth:`_advance_and_append`); writes the seq ids,
        tokens and :class:`FinishReason` codes of the sample rows. Returns 0.

        Raises:
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        self._fork_groups(batch)
        cdef int rc, r
        with nogil:
            rc = self._advance_and_append(batch, sampled, out_ids, out_tokens, out_finish)
        if rc < 0:
            raise_alloc_error(rc, self._allocator.err_block)
        for r in range(batch.num_sampled if rc > 0 else 0):
            if out_finish[r] == FinishReason.STOPPED or out_finish[r] == FinishReason.LENGTH:
                del self._slot_of[out_ids[r]]
        return 0

    cdef int apply_spec_step(self, BatchBuilder batch, const int32_t[:, ::1] sampled,
                             const int32_t[::1] counts, int64_t[::1] out_ids,
                             int32_t[::1] out_tokens, int8_t[::1] out_finish,
                             int32_t[::1] out_index) except -1:
        """:meth:`apply_step` of a speculative step: sample row r emitted ``counts[r]`` tokens
        ``sampled[r, :counts[r]]`` (its accepted drafts, then the target's token); they are
        appended in order until one finishes the sequence. Writes one output row per appended
        token (``out_index``: its flat index ``r * W + j`` in ``sampled``). Returns the number
        of output rows.

        Raises:
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        self._fork_groups(batch)
        cdef int rc
        cdef int32_t r
        with nogil:
            rc = self._advance_and_append_spec(batch, sampled, counts, out_ids, out_tokens,
                                               out_finish, out_index)
        if rc < 0:
            raise_alloc_error(rc, self._allocator.err_block)
        for r in range(rc):
            if out_finish[r] == FinishReason.STOPPED or out_finish[r] == FinishReason.LENGTH:
                del self._slot_of[out_ids[r]]
        return rc

    cdef int _fork_groups(self, BatchBuilder batch) except -1:
        """Create the siblings of every group whose prompt completes in the in-flight batch:
        a copy of the parent after the step, sharing its blocks, at the back of running."""
        cdef int32_t r, i, p, c
        for r in range(batch.num_sampled):
            i, p = batch.sample_fork[r], batch.sample_slots[r]
            if i == 0:
                continue
            if (self.st.seqs[p].status != SEQ_RUNNING
                    or self.st.seqs[p].seq_id + i != batch.sample_seq_ids[r]):
                batch.set_sample_slot(r, -1)    # parent finished meanwhile: no sibling
                continue
            c = self._clone_running(p, self.st.seqs[p].seq_id + i)
            self.st.seqs[p].num_samples -= 1   # its share of the group's weight moves to c
            batch.set_sample_slot(r, c)
        return 0

    cdef int32_t _clone_running(self, int32_t p, int64_t new_seq_id) except -1:
        """A new running sequence ``new_seq_id``, a copy of running slot ``p`` after the
        in-flight step (see ``store_clone``), sharing each of its blocks (one more
        reference), at the back of the running queue. Returns its slot."""
        # NOTE: store_new_slot may move the arena and the slot arrays: index, never hold
        cdef int32_t c = store_new_slot(&self.st, new_seq_id, self.st.seqs[p].num_stop,
                                        self.st.seqs[p].cap_tokens)
        self._slot_of[new_seq_id] = c
        store_clone(&self.st, p, c)
        raise_alloc_error(self._allocator.fork_blocks(
            block_table_row(&self.st, p), block_table_row(&self.st, c), self.st.seqs[p].num_blocks),
            self._allocator.err_block)
        self.st.seqs[c].num_blocks = self.st.seqs[p].num_blocks
        self.st.seqs[c].status = SEQ_RUNNING
        self.st.running[self.num_running] = c
        self.num_running += 1
        return c

    cdef int fork(self, int64_t seq_id, int64_t new_seq_id, int32_t last_token,
                  int32_t max_weight) except -1:
        """Beam search: a new running sequence ``new_seq_id`` that is ``seq_id`` with its last
        (not yet computed) token replaced by ``last_token``. It shares every block of
        ``seq_id`` (one more reference each); the partial last block is copied on its first
        write (``allocate_slots``). Weighs 1 in ``running_weight``. Returns its slot.

        Raises:
            ValueError: ``seq_id`` is not running between steps with exactly its last token
                uncomputed, ``new_seq_id`` is in use, or ``running_weight`` would exceed
                ``max_weight`` (the scheduler's ``max_num_seqs``: the batch's row capacity).
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        cdef int32_t p = self.find(seq_id), c
        if p < 0 or self.st.seqs[p].status != SEQ_RUNNING or self.st.seqs[p].num_scheduled \
                or self.st.seqs[p].num_computed != self.st.seqs[p].num_tokens - 1:
            raise ValueError(f"`seq_id` must be a running sequence between steps whose last "
                             f"token only is uncomputed, got {seq_id}")
        if self.find(new_seq_id) >= 0:
            raise ValueError(f"`new_seq_id` must be unused, got {new_seq_id}")
        if self.running_weight + 1 > max_weight:
            raise ValueError(f"fork() needs a free place under max_num_seqs ({max_weight}), "
                             f"got {self.running_weight} running")
        c = self._clone_running(p, new_seq_id)
        seq_tokens(&self.st, &self.st.seqs[c])[self.st.seqs[c].num_tokens - 1] = last_token
        self.running_weight += 1
        return c

    cdef bint finish(self, int64_t seq_id) except -1:
        """End ``seq_id`` now, waiting or running (an unforked group goes as a whole): out of
        its queue, blocks freed, slot released. Returns False when the id is unknown.

        Raises:
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        cdef int32_t slot = self.find(seq_id), i = 0
        if slot < 0:
            return False
        cdef int32_t* queue = self.st.waiting
        cdef int32_t* count = &self.num_waiting
        if self.st.seqs[slot].status == SEQ_RUNNING:
            queue, count = self.st.running, &self.num_running
            self.running_weight -= self.st.seqs[slot].num_samples
        while queue[i] != slot:
            i += 1
        count[0] -= 1
        memmove(queue + i, queue + i + 1, (count[0] - i) * sizeof(int32_t))
        raise_alloc_error(self.free_blocks(slot), self._allocator.err_block)
        store_release(&self.st, slot)
        del self._slot_of[seq_id]
        return True

    # ---- GIL released ------------------------------------------------------------------------

    cdef int free_blocks(self, int32_t slot) noexcept nogil:
        """Drop the sequence's reference to each of its blocks, last block first (cached ones
        stay findable until evicted); its prefix-hash state restarts at block 0 (its root)."""
        cdef SeqState* s = &self.st.seqs[slot]
        s.num_hashed, s.last_hash = 0, s.hash_root
        return self._allocator.free_blocks(block_table_row(&self.st, slot), &s.num_blocks)

    cdef int take_cached_prefix(self, int32_t slot) noexcept nogil:
        """Admission with prefix caching: waiting ``slot`` (no blocks) takes its longest chain
        of cached full blocks, at most ``num_tokens - 1`` tokens (the last token is always
        computed and sampled); ``num_computed`` = the hit tokens. Returns them or an error."""
        cdef SeqState* s = &self.st.seqs[slot]
        cdef int32_t bs = self._allocator.block_size
        cdef int k = self._allocator.get_computed_blocks(
            seq_tokens(&self.st, s), (s.num_tokens - 1) // bs, block_table_row(&self.st, slot),
            &s.num_blocks, &s.last_hash)
        if k < 0:
            return k
        s.num_hashed, s.num_computed = k, k * bs
        return s.num_computed

    cdef void admit(self, int32_t slot) noexcept nogil:
        """Waiting ``slot`` starts running (back of the running queue); the caller drops it
        from the waiting queue with :meth:`pop_waiting`."""
        self.st.seqs[slot].status = SEQ_RUNNING
        self.st.running[self.num_running] = slot
        self.num_running += 1
        self.running_weight += self.st.seqs[slot].num_samples

    cdef void pop_waiting(self, int32_t k) noexcept nogil:
        """Drop the first ``k`` entries of the waiting queue (they were admitted)."""
        self.num_waiting -= k
        memmove(self.st.waiting, self.st.waiting + k, self.num_waiting * sizeof(int32_t))

    cdef int preempt_last(self) noexcept nogil:
        """Preempt the most recently admitted running sequence (recompute): blocks freed,
        ``num_computed = 0``, front of the waiting queue. Returns 0 or an error code."""
        self.num_running -= 1
        cdef int32_t slot = self.st.running[self.num_running]
        cdef SeqState* s = &self.st.seqs[slot]
        self.running_weight -= s.num_samples
        cdef int rc = self.free_blocks(slot)
        if rc != 0:
            return rc
        s.num_computed, s.num_scheduled, s.num_spec, s.status = 0, 0, 0, SEQ_WAITING
        memmove(self.st.waiting + 1, self.st.waiting, self.num_waiting * sizeof(int32_t))
        self.st.waiting[0] = slot
        self.num_waiting += 1
        return 0

    cdef int _advance_and_append(self, BatchBuilder batch, const int32_t[::1] sampled,
                                 int64_t[::1] out_ids, int32_t[::1] out_tokens,
                                 int8_t[::1] out_finish) noexcept nogil:
        """Advance num_computed of every row (registering newly full blocks), append sampled
        tokens, finish and free. Returns the number of finished sequences or an error code."""
        cdef int32_t b, r, slot, finished = 0
        cdef FinishReason fin
        cdef int rc
        cdef SeqState* s
        cdef SlotStore* st = &self.st
        cdef bint caching = self._allocator.enable_prefix_caching
        # hoisted out of the loops (the compiler cannot prove the batch's arrays unchanged)
        cdef const int32_t* row_slots = batch.row_slots
        cdef const int32_t* sample_slots = batch.sample_slots
        cdef const int64_t* row_ids = &batch.seq_ids[0]
        cdef const int64_t* sample_ids = &batch.sample_seq_ids[0]
        for b in range(batch.num_rows):
            s = &st.seqs[row_slots[b]]
            if s.status == SEQ_RUNNING and s.seq_id == row_ids[b]:
                s.num_computed += s.num_scheduled
                s.num_scheduled = 0
                if caching:
                    self._allocator.prefix_cache.cache_full_blocks(
                        block_table_row(st, row_slots[b]), seq_tokens(st, s), s.num_computed,
                        &s.num_hashed, &s.last_hash)
        for r in range(batch.num_sampled):
            slot = sample_slots[r]
            out_ids[r], out_tokens[r] = sample_ids[r], sampled[r]
            if (slot < 0 or st.seqs[slot].status != SEQ_RUNNING
                    or st.seqs[slot].seq_id != sample_ids[r]):
                out_finish[r] = FinishReason.ABORTED    # finished while its batch was in flight
                continue
            s = &st.seqs[slot]
            if sampled[r] < 0:  # NOTE: token declined (beam search): recompute the last one
                s.num_computed -= 1
                out_finish[r] = FinishReason.NONE
                continue
            fin = append_token(st, s, sampled[r], self._max_model_len)
            out_finish[r] = fin
            if fin != FinishReason.NONE:
                rc = self._release_finished(slot)
                if rc != 0:
                    return rc
                finished += 1
        if finished:
            self._drop_finished_running()
        return finished

    cdef int _release_finished(self, int32_t slot) noexcept nogil:
        """A sequence that just finished in a step: free its blocks, take its samples off the
        running weight and release its slot (it leaves the running queue in
        :meth:`_drop_finished_running`). Returns the allocator's error code (0: ok)."""
        cdef SeqState* s = &self.st.seqs[slot]
        cdef int rc = self.free_blocks(slot)
        if rc != 0:
            return rc
        self.running_weight -= s.num_samples
        store_release(&self.st, slot)
        return 0

    cdef void _drop_finished_running(self) noexcept nogil:
        """Drop the finished sequences from the running queue, order kept."""
        cdef SlotStore* st = &self.st
        cdef int32_t b, r = 0
        for b in range(self.num_running):
            if st.seqs[st.running[b]].status == SEQ_RUNNING:
                st.running[r] = st.running[b]
                r += 1
        self.num_running = r

    cdef int _advance_and_append_spec(self, BatchBuilder batch, const int32_t[:, ::1] sampled,
                                      const int32_t[::1] counts, int64_t[::1] out_ids,
                                      int32_t[::1] out_tokens, int8_t[::1] out_finish,
                                      int32_t[::1] out_index) noexcept nogil:
        """:meth:`_advance_and_append` for a speculative step. A row with m drafts computed
        its last token and the m drafts; of those, the last token and the a accepted drafts
        (``counts[r] = a + 1`` emitted) hold valid KV, so ``num_computed`` advances by
        ``counts[r]``, and blocks past those covering its tokens (only rejected drafts used
        them) are freed. Returns the output rows written or an error code."""
        cdef int32_t b, r, j, slot, n_out = 0, W = sampled.shape[1]
        cdef int32_t bs = self._allocator.block_size
        cdef FinishReason fin = FinishReason.NONE
        cdef int rc
        cdef bint any_finished = False
        cdef SeqState* s
        cdef SlotStore* st = &self.st
        cdef bint caching = self._allocator.enable_prefix_caching
        for b in range(batch.num_rows):
            s = &st.seqs[batch.row_slots[b]]
            if s.status == SEQ_RUNNING and s.seq_id == batch.seq_ids[b] and s.num_spec == 0:
                s.num_computed += s.num_scheduled
                s.num_scheduled = 0
                if caching:
                    self._allocator.prefix_cache.cache_full_blocks(
                        block_table_row(st, batch.row_slots[b]), seq_tokens(st, s), s.num_computed,
                        &s.num_hashed, &s.last_hash)
        for r in range(batch.num_sampled):
            slot = batch.sample_slots[r]
            if (slot < 0 or st.seqs[slot].status != SEQ_RUNNING
                    or st.seqs[slot].seq_id != batch.sample_seq_ids[r]):
                out_ids[n_out], out_tokens[n_out] = batch.sample_seq_ids[r], sampled[r, 0]
                out_finish[n_out], out_index[n_out] = FinishReason.ABORTED, r * W
                n_out += 1
                continue
            s = &st.seqs[slot]
            for j in range(counts[r]):
                fin = append_token(st, s, sampled[r, j], self._max_model_len)
                out_ids[n_out], out_tokens[n_out] = batch.sample_seq_ids[r], sampled[r, j]
                out_finish[n_out], out_index[n_out] = fin, r * W + j
                n_out += 1
                if fin != FinishReason.NONE:
                    break
            if fin != FinishReason.NONE:
                rc = self._release_finished(slot)
                if rc != 0:
                    return rc
                any_finished = True
                fin = FinishReason.NONE
                continue
            if s.num_spec > 0:
                s.num_computed += counts[r]
                s.num_scheduled = s.num_spec = 0
                if caching:
                    self._allocator.prefix_cache.cache_full_blocks(
                        block_table_row(st, slot), seq_tokens(st, s), s.num_computed,
                        &s.num_hashed, &s.last_hash)
                rc = self._allocator.free_tail(block_table_row(st, slot), &s.num_blocks,
                                               cdiv(s.num_tokens, bs))
                if rc != 0:
                    return rc
        if any_finished:
            self._drop_finished_running()
        return n_out

    # ---- Python face (tests, debugging) ------------------------------------------------------

    def block_ids(self, int64_t seq_id):
        """Copy of the block table of ``seq_id`` (int32[num_blocks]).

        Raises:
            KeyError: ``seq_id`` is not waiting or running.
        """
        cdef int32_t slot = self.find(seq_id)
        if slot < 0:
            raise KeyError(f"`seq_id` must be a waiting or running sequence, got {seq_id}")
        cdef int32_t* table = block_table_row(&self.st, slot)
        return np.array([table[k] for k in range(self.st.seqs[slot].num_blocks)], np.int32)

    def debug_state(self) -> dict:
        """Copies for tests: ``seqs`` (seq_id -> dict of status, token counts, num_samples,
        ``block_ids``, ``token_ids``), ``running`` / ``waiting`` (seq ids in queue order) and
        ``running_weight``."""
        seqs = {}
        cdef SeqState* s
        cdef int32_t* tok
        for seq_id, slot in self._slot_of.items():
            s = &self.st.seqs[<int32_t> slot]
            tok = seq_tokens(&self.st, s)
            seqs[seq_id] = {
                "status": _STATUS_NAMES[s.status], "num_prompt_tokens": s.num_prompt_tokens,
                "num_tokens": s.num_tokens, "num_computed": s.num_computed,
                "max_tokens": s.max_tokens, "num_samples": s.num_samples,
                "block_ids": self.block_ids(seq_id),
                "token_ids": np.array([tok[k] for k in range(s.num_tokens)], dtype=np.int32)}
        return {"seqs": seqs, "running_weight": self.running_weight,
                "running": [self.st.seqs[self.st.running[k]].seq_id
                            for k in range(self.num_running)],
                "waiting": [self.st.seqs[self.st.waiting[k]].seq_id
                            for k in range(self.num_waiting)]}
