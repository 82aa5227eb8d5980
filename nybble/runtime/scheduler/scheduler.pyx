# cython: language_level=3
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
   is deferred until it fits whole, except a prompt longer than the whole budget, which is
   chunked anyway (it could never fit, and refusing it would deadlock recompute after
   preemption).

A sequence is sampled in a step iff after the step ``num_computed == num_tokens``. Prefill,
chunked prefill, decode and recompute after preemption (prompt + generated tokens become the
prefill) all fall out of this one rule. The token regions of one sequence and the blocks they
need are drawn in ``BlockAllocator.allocate_slots``. After the step, ``update`` advances
``num_computed``, appends the sampled tokens, forks parallel-sampling groups (the siblings
share the prompt's blocks), registers newly full blocks in the prefix cache, and finishes and
frees sequences in the same step.

Speculative decoding (``num_lookahead_slots`` k > 0): a running sequence that decodes (one
token to compute) is scheduled ``1 + m`` tokens, ``m <= k`` draft tokens after its last one
(vLLM's lookahead slots), so the target verifies them in the same varlen forward. ``m`` is cut
so that accepting every draft plus the bonus token stays within ``max_tokens`` and
``max_model_len``, and within the step's budget; with n-gram proposals (made here, from the
sequence's own tokens, see ngram.pxd) it is the proposal's length, and 0 (a plain decode row)
when nothing matches. The drafts sit in the sequence's token region as scratch after its last
token (the batch builder copies them into ``input_ids``; a draft model's runner overwrites
them). :meth:`Scheduler.update_spec` then appends the 1..m+1 tokens the verification emitted
and frees the blocks that only rejected drafts used.

Sliding windows (vLLM's sliding-window KV manager, ``sliding_window`` W: given only when
*every* attention layer has a window, W the largest): a layer with window W lets the query at
position i see keys ``i - W < j <= i``, so a step whose earliest query sits at
``q0 = num_computed`` reads no key below ``q0 - W + 1``, and neither does any later step.
Before a sequence's blocks are drawn (``_allocate``), its leading ``(q0 - W + 1) //
block_size`` blocks -- every position in them below ``q0 - W + 1`` -- are released
(``BlockAllocator.remove_skipped_blocks``: a block shared by a fork or a prefix hit stays
alive for the others, a cached one stays cached and evictable) and their entries point at the
reserved null block 0, which the kernels may read (masked out) but nobody writes. The prefix
cache hits as before: a hit takes a chain of blocks still cached from block 0 on, and the
ones already out of the window are released at once. A sequence then holds at most
``ceil((W - 1 + max_num_batched_tokens) / block_size) + 1`` blocks (scheduler_input's
``window_blocks``), which the fit rule below counts instead of its whole length.

A request whose ``min(prompt + max_tokens, max_model_len)`` tokens need more blocks than the
pool holds (with a window: more than the window's blocks, the null block not counted) is
rejected in :meth:`Scheduler.add` (KVCacheExhaustedError), so the oldest running
sequence always fits alone and the scheduler never deadlocks. Contract: every non-empty batch
from :meth:`schedule` is passed to :meth:`update` (or, when its step failed, to
:meth:`abort_batch`) before the next :meth:`schedule`.
:mod:`nybble.runtime.scheduler.reference_scheduler` is the same rule in plain Python (the tests'
oracle).
"""
from libc.stdint cimport int32_t, int64_t, uint64_t

import numpy as np

from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.scheduler.scheduler_input import check_add, check_sizes, check_window

from nybble.runtime.scheduler.block_allocator cimport ALLOC_NO_SPACE, raise_alloc_error
from nybble.runtime.scheduler.ngram cimport ngram_propose
from nybble.runtime.scheduler.sequence cimport (FinishReason, SeqState, SlotStore,
                                                block_table_row, cdiv, seq_tokens)


cdef enum StepStatus:
    # Outcome of giving one sequence tokens this step (>= 0; allocator errors pass through < 0)
    SCHEDULED = 0   # its blocks cover the tokens; it is a row of the batch
    NO_SPACE = 1    # the pool is short: preempt (running) or stop admitting (waiting)
    DEFERRED = 2    # not admitted now though the pool may hold it: chunked prefill is off and
                    # the whole prompt fits a later step's budget, not this step's remainder


cdef class Scheduler:
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
        num_lookahead_slots: speculative decoding: draft tokens k per decoding sequence and
            step (0: off).
        ngram_min, ngram_max: propose the drafts by n-gram lookup of ``ngram_min ..
            ngram_max`` tokens (0: the runner's draft model fills them).
        sliding_window: free blocks out of this window (tokens; the model's largest, given
            only when every attention layer has one; see the module docstring), or None.
            Block 0 is then the null block and the pool hands out ``num_blocks - 1``.

    Raises:
        ValueError: a size is below 1, bad lookahead / n-gram sizes, a window below 1, or
            ``num_blocks`` < 2 with a window.
    """

    def __init__(self, int num_blocks, int block_size, int max_num_seqs,
                 int max_num_batched_tokens, int max_model_len,
                 bint enable_chunked_prefill=True, bint enable_prefix_caching=False,
                 int num_lookahead_slots=0, int ngram_min=0, int ngram_max=0,
                 sliding_window=None):
        check_sizes(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
        self._window = check_window(sliding_window)
        if num_lookahead_slots < 0 or (ngram_max > 0 and not 1 <= ngram_min <= ngram_max):
            raise ValueError(f"num_lookahead_slots must be >= 0 and, with n-gram proposals, "
                             f"1 <= ngram_min <= ngram_max, got {num_lookahead_slots}, "
                             f"{ngram_min}, {ngram_max}")
        self.num_lookahead_slots = num_lookahead_slots
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len, self.enable_chunked_prefill = max_model_len, enable_chunked_prefill
        self._allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching,
                                         self._window > 0)
        self.prefix_cache = self._allocator.prefix_cache
        cdef int32_t max_blocks_per_seq = cdiv(max_model_len, block_size)
        self._seqs = SequenceTable(self._allocator, max_model_len, max_blocks_per_seq)
        self._batch = BatchBuilder(max_num_seqs, max_num_batched_tokens, max_blocks_per_seq,
                                   block_size, num_lookahead_slots > 0)

    # ---- C core (GIL released; errors are negative AllocStatus codes) -------------------------

    cdef int _allocate(self, int32_t slot, int32_t num_new) noexcept nogil:
        """Cover ``num_new`` tokens of ``slot`` with blocks (recording a copy-on-write pair).
        Returns SCHEDULED, NO_SPACE (nothing changed) or an error code."""
        cdef SeqState* s = &self._seqs.st.seqs[slot]
        cdef int32_t* table = block_table_row(&self._seqs.st, slot)
        cdef int32_t src, dst, first = s.num_computed - self._window + 1
        cdef int rc
        if self._window > 0 and first >= self.block_size:
            # the step's earliest query (num_computed) reads no key below `first`. NOTE: a
            # sibling forked after a step hashes the step's blocks late: register them
            # before they leave (a null entry must never be cached)
            if self.prefix_cache is not None:
                self.prefix_cache.cache_full_blocks(table, seq_tokens(&self._seqs.st, s),
                                                    s.num_computed, &s.num_hashed,
                                                    &s.last_hash)
            rc = self._allocator.remove_skipped_blocks(table, s.num_blocks,
                                                       first // self.block_size)
            if rc < 0:
                return rc
            self.num_window_freed_blocks += rc
        rc = self._allocator.allocate_slots(table, &s.num_blocks, s.num_computed, num_new,
                                            &src, &dst)
        if rc == ALLOC_NO_SPACE:
            return NO_SPACE
        if rc == 0 and src >= 0:
            self._batch.add_copy(src, dst)
        return rc

    cdef int32_t _num_spec(self, int32_t slot, int32_t budget) noexcept nogil:
        """Draft tokens for running ``slot`` this step (0 unless it decodes): at most k, and
        at most what ``max_tokens``, ``max_model_len`` and ``budget`` leave after its last
        token; with n-gram proposals, the proposal's length (written as scratch after it)."""
        cdef SeqState* s = &self._seqs.st.seqs[slot]
        if s.num_tokens - s.num_computed != 1:
            return 0
        cdef int32_t m = min(self.num_lookahead_slots, budget - 1)
        m = min(m, s.max_tokens - (s.num_tokens - s.num_prompt_tokens) - 1)
        m = min(m, self.max_model_len - s.num_tokens)
        if m <= 0:
            return 0
        if self.ngram_max > 0:
            m = ngram_propose(seq_tokens(&self._seqs.st, s), s.num_tokens, self.ngram_min,
                              self.ngram_max, m, seq_tokens(&self._seqs.st, s) + s.num_tokens)
        return m

    cdef int _schedule_running(self, int32_t* budget) noexcept nogil:
        """Step 1: running sequences, oldest first. Returns preemptions (>= 0) or an error."""
        cdef SlotStore* st = &self._seqs.st
        cdef int32_t i = 0, slot, victim, n, spec = 0, preempted = 0
        cdef int rc
        cdef SeqState* s
        while i < self._seqs.num_running and budget[0] > 0:
            slot = st.running[i]
            s = &st.seqs[slot]
            if self.num_lookahead_slots > 0:
                spec = self._num_spec(slot, budget[0])
            n = min(s.num_tokens - s.num_computed + spec, budget[0])
            victim = -1
            rc = self._allocate(slot, n)
            while rc == NO_SPACE:       # preempt the newest until it fits (or was the newest)
                victim = st.running[self._seqs.num_running - 1]
                rc = self._seqs.preempt_last()
                preempted += 1
                if rc != 0 or victim == slot:
                    break
                rc = self._allocate(slot, n)
            if rc < 0:
                return rc
            if victim == slot:      # preempted itself: everything after it is gone too
                break
            s.num_scheduled, s.num_spec = n, spec
            self._batch.add_row(slot)
            budget[0] -= n
            i += 1
        self.num_preemptions += preempted
        return preempted

    cdef int _schedule_waiting(self, int32_t* budget) noexcept nogil:
        """Step 2: admit waiting sequences FCFS (head-of-line). Returns 0 or an error."""
        cdef SlotStore* st = &self._seqs.st
        cdef bint caching = self._allocator.enable_prefix_caching
        cdef int32_t k = 0, slot, n, hit = 0
        cdef int rc = SCHEDULED
        cdef SeqState* s
        while k < self._seqs.num_waiting and budget[0] > 0:
            slot = st.waiting[k]
            s = &st.seqs[slot]
            if self._seqs.running_weight + s.num_samples > self.max_num_seqs:
                break
            hit = 0
            if caching and not s.skip_cache:
                hit = self._seqs.take_cached_prefix(slot)
                if hit < 0:
                    rc = hit
                    break
            n, rc = s.num_tokens - s.num_computed, SCHEDULED
            if n > budget[0]:
                if not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                    rc = DEFERRED
                n = budget[0]
            if rc == SCHEDULED:
                rc = self._allocate(slot, n)
            if rc != SCHEDULED:
                if rc > 0 and s.num_blocks > 0:     # not admitted: give the hits back
                    rc = self._seqs.free_blocks(slot)
                    s.num_computed = 0
                break
            if caching:
                self.num_prefix_hit_tokens += hit
                self.num_prefix_query_tokens += s.num_tokens
            s.num_scheduled, s.num_spec = n, 0
            self._seqs.admit(slot)
            self._batch.add_row(slot)
            budget[0] -= n
            k += 1
        self._seqs.pop_waiting(k)
        return rc if rc < 0 else 0

    # ---- Python face -------------------------------------------------------------------------

    def add(self, int64_t seq_id, token_ids, int64_t max_tokens, stop_token_ids=(),
            int num_samples=1, bint skip_prefix_cache=False, uint64_t cache_salt=0) -> None:
        """Queue a request (FCFS) under ``seq_id`` (a group owns seq_id .. seq_id+num_samples-1).

        Args:
            seq_id: engine-chosen id (>= 0, unused).
            token_ids: 1-D prompt token ids (tokens).
            max_tokens: generation budget (>= 1 tokens; generated tokens count after preemption).
            stop_token_ids: 1-D ids that finish the sequence (FinishReason.STOPPED) when sampled.
            num_samples: parallel samples sharing the prompt's blocks (1..max_num_seqs).
            skip_prefix_cache: never take cached blocks for this sequence, so every prompt
                position is computed (vLLM does so for requests asking for prompt logprobs);
                its own full blocks still enter the cache.
            cache_salt: the root of the sequence's prefix-hash chain (0: the shared one); the
                engine gives each LoRA adapter its own, so KV computed under one adapter is
                never reused by another or by the base model.

        Raises:
            ValueError: empty prompt, prompt > max_model_len, bad max_tokens / num_samples /
                seq_id, or an id already in use.
            KVCacheExhaustedError: ``min(prompt + max_tokens, max_model_len)`` tokens need more
                blocks than the whole pool.
        """
        prompt, stops, total = check_add(self, seq_id, token_ids, max_tokens, stop_token_ids,
                                         num_samples)
        self._seqs.add(seq_id, prompt, stops, max_tokens, num_samples,
                       max(total, prompt.shape[0] + 1), skip_prefix_cache, cache_salt)

    def __contains__(self, int64_t seq_id) -> bool:
        """True when ``seq_id`` is waiting or running."""
        return self._seqs.find(seq_id) >= 0

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
        cdef int32_t budget = self.max_num_batched_tokens
        cdef int rc
        with nogil:
            self._batch.reset()
            rc = self._schedule_running(&budget)
            if rc == 0:
                rc = self._schedule_waiting(&budget)
            if rc >= 0:
                self._batch.build(&self._seqs.st)
        if rc < 0:
            raise_alloc_error(rc, self._allocator.err_block)
        self._inflight = self._batch.view()
        return self._inflight

    def update(self, batch, sampled):
        """Apply one step's results: advance num_computed of every row, append each sampled
        token, fork groups, finish (a stop id -> STOPPED, max_tokens / max_model_len ->
        LENGTH) and free.

        Args:
            batch: the ScheduledBatch returned by the last ``schedule()``.
            sampled: int32[S] token ids, one per ``batch.sample_rows`` entry; ``-1`` declines
                a row's token (beam search, when a sibling beam was not sampled in this
                step): nothing is appended, the last token is computed again next step,
                and its finish code is 0.

        Returns:
            (seq_ids int64[S], tokens int32[S], finish int8[S]) with :class:`FinishReason`
            codes; ABORTED marks a row whose sequence was finished (finish()) while the batch
            was in flight.

        Raises:
            ValueError: ``batch`` is not the pending batch, ``sampled`` has the wrong shape,
                or the batch holds draft tokens (those go to :meth:`update_spec`).
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        self._check_pending(batch)
        arr = np.ascontiguousarray(sampled, dtype=np.int32)
        cdef int32_t S = self._batch.num_sampled
        if arr.ndim != 1 or arr.shape[0] != S:
            raise ValueError(f"`sampled` must have shape ({S},), got {arr.shape}")
        if self.num_lookahead_slots > 0 and batch.num_draft_tokens.any():
            raise ValueError("a batch with draft tokens must be passed to update_spec(), "
                             "got update()")
        self._inflight = None
        ids, tokens, finish = np.empty(S, np.int64), np.empty(S, np.int32), np.empty(S, np.int8)
        self._seqs.apply_step(self._batch, arr, ids, tokens, finish)
        return ids, tokens, finish

    def update_spec(self, batch, sampled, counts):
        """:meth:`update` for a speculative step: sample row ``r`` emitted ``counts[r]``
        tokens ``sampled[r, :counts[r]]`` (1..m+1 for a row with m = ``num_draft_tokens[r]``
        drafts: the accepted drafts, then the target's token); each is appended in order
        until one finishes the sequence, ``num_computed`` advances by ``counts[r]`` and the
        blocks only rejected drafts used are freed.

        Args:
            batch: the ScheduledBatch returned by the last ``schedule()``.
            sampled: int32[S, W] token ids (W >= 1 + the largest m).
            counts: int32[S] tokens emitted per sample row.

        Returns:
            (seq_ids int64[N], tokens int32[N], finish int8[N], index int32[N]): one row per
            appended token, a sequence's rows in order, a finish code only on its last;
            ``index`` is the token's flat position ``r * W + j`` in ``sampled``.

        Raises:
            ValueError: ``batch`` is not the pending batch, or bad shapes or counts.
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        self._check_pending(batch)
        arr = np.ascontiguousarray(sampled, dtype=np.int32)
        num = np.ascontiguousarray(counts, dtype=np.int32)
        cdef int32_t S = self._batch.num_sampled
        drafts = batch.num_draft_tokens
        if drafts is None:
            raise ValueError("update_spec() needs a scheduler built with num_lookahead_slots "
                             "> 0, got a batch without draft counts")
        if arr.ndim != 2 or arr.shape[0] != S or num.shape != (S,):
            raise ValueError(f"`sampled` must have shape ({S}, W) and `counts` ({S},), got "
                             f"{arr.shape} and {num.shape}")
        if S and (num.min() < 1 or (num > drafts + 1).any() or num.max() > arr.shape[1]):
            raise ValueError("`counts` must be in [1, num_draft_tokens + 1] and <= W, got "
                             f"{num.tolist()} for drafts {drafts.tolist()}")
        self._inflight = None
        total = int(num.sum())
        ids, tokens = np.empty(total, np.int64), np.empty(total, np.int32)
        finish, index = np.empty(total, np.int8), np.empty(total, np.int32)
        cdef int n = self._seqs.apply_spec_step(self._batch, arr, num, ids, tokens, finish,
                                                index)
        return ids[:n], tokens[:n], finish[:n], index[:n]

    def _check_pending(self, batch) -> None:
        if self._inflight is None or batch is not self._inflight:
            raise ValueError("`batch` must be the batch returned by the last schedule() and "
                             "not yet updated, got a stale or foreign batch")

    def abort_batch(self, batch):
        """Give up on the in-flight ``batch`` (its step raised before :meth:`update`): every
        sequence it holds is finished (ABORTED: out of its queue, blocks freed) and the batch
        is forgotten, so the next :meth:`schedule` starts from a consistent state. Blocks
        written by the failed step are never registered in the prefix cache (that happens
        in ``update``). Sequences outside the batch are untouched.

        Returns:
            int64[B] the seq ids of the batch's rows (an unforked group went as a whole).

        Raises:
            ValueError: ``batch`` is not the pending batch.
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        self._check_pending(batch)
        ids = np.array(batch.seq_ids[:batch.num_seqs], dtype=np.int64)
        self._inflight = None
        for seq_id in ids.tolist():
            self._seqs.finish(seq_id)
        return ids

    def fork(self, int64_t seq_id, int64_t new_seq_id, int last_token) -> None:
        """Beam search: start ``new_seq_id`` as a copy of running ``seq_id`` (after
        :meth:`update`) whose last, uncomputed token is ``last_token`` instead. It shares
        the blocks of ``seq_id`` by reference count (fork), the partial last block is
        copied on its first write, and it joins the back of the running queue (weight 1).

        Raises:
            ValueError: ``seq_id`` is not running with only its last token uncomputed, a
                batch is in flight, ``new_seq_id`` is in use, or ``max_num_seqs`` sequences
                already run (finish pruned beams first).
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        if self._inflight is not None and self._inflight.num_seqs > 0:
            raise ValueError("fork() needs no batch in flight: call update() first")
        self._seqs.fork(seq_id, new_seq_id, last_token, self.max_num_seqs)

    def finish(self, int64_t seq_id, int reason) -> None:
        """Finish ``seq_id`` now (:class:`FinishReason` STOPPED for a stop string, LENGTH, or
        ABORTED) and free its blocks. No-op when the id is unknown or already finished; an
        unforked group goes as a whole.

        Raises:
            ValueError: ``reason`` is not 1, 2 or 3.
            RuntimeError: the block bookkeeping is corrupt (a bug).
        """
        if reason not in (FinishReason.STOPPED, FinishReason.LENGTH, FinishReason.ABORTED):
            raise ValueError(f"`reason` must be 1, 2 or 3, got {reason}")
        self._seqs.finish(seq_id)

    def has_unfinished(self) -> bool:
        """True while any sequence is waiting or running."""
        return self._seqs.num_running + self._seqs.num_waiting > 0

    @property
    def num_running(self) -> int:
        """Sequences in the running queue (an unforked group is one entry)."""
        return self._seqs.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences in the waiting queue (new and preempted)."""
        return self._seqs.num_waiting

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks in the pool (parked prefix-cache blocks count as free; the null
        block does not)."""
        return self._allocator.get_num_free_blocks()

    @property
    def sliding_window(self):
        """The window whose out-of-window blocks are freed (tokens), or None."""
        return self._window if self._window > 0 else None

    @property
    def null_block(self) -> int:
        """The reserved null block (0) with a sliding window, else -1."""
        return self._allocator.null_block

    def seq_block_ids(self, int64_t seq_id):
        """Copy of the block table of ``seq_id`` (int32[num_blocks]; entries freed by the
        sliding window are the null block).

        Raises:
            KeyError: ``seq_id`` is not waiting or running.
        """
        return self._seqs.block_ids(seq_id)

    def debug_state(self) -> dict:
        """Copies for tests: the allocator's (``ref_counts``, ``free_list``, ``evictable``,
        ``null_block``) and the sequence table's (``seqs``: seq_id -> status, token counts,
        ``block_ids``, ``token_ids``; ``running`` and ``waiting`` seq ids in queue order; ``running_weight``)."""
        return {**self._allocator.debug_state(), **self._seqs.debug_state()}
