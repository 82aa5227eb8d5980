# cython: language_level=3
"""C-level declarations of the sequence table (rules in seq_table.pyx).

Public C surface for the Scheduler (every field with a leading underscore is private):

* ``st``: the SlotStore (per-slot SeqState, block-table rows, token arena, queue storage); the
  Scheduler reads it and sets ``num_scheduled``; ``find`` maps a seq_id to its slot;
* the queues: ``st.waiting[0:num_waiting]`` (FCFS, front = index 0) and
  ``st.running[0:num_running]`` (admission order, oldest first), with ``running_weight``;
* the state changes of a sequence: ``add`` (new, back of waiting), ``take_cached_prefix`` and
  ``admit`` / ``pop_waiting`` (admission), ``preempt_last``, ``apply_step`` (a step's results:
  advance, fork, append, finish; ``apply_spec_step`` for a speculative one), ``finish``,
  ``fork`` (beam search), ``free_blocks``.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint64_t

from nybble.runtime.scheduler.batch_builder cimport BatchBuilder
from nybble.runtime.scheduler.block_allocator cimport BlockAllocator
from nybble.runtime.scheduler.sequence cimport SlotStore


cdef class SequenceTable:
    # field           type            meaning (units)
    # --------------  --------------  -------------------------------------------------------------
    # st              SlotStore       slots, block tables, token arena, queue storage (public)
    # num_running     int32           running queue length (an unforked group is one entry)
    # num_waiting     int32           waiting queue length (new and preempted)
    # running_weight  int32           sum of num_samples over running (the seq-cap weight)
    # _allocator      BlockAllocator  the KV pool the sequences' blocks come from
    # _max_model_len  int32           context limit L (tokens)
    # _slot_of        dict            seq_id -> slot of every waiting or running sequence
    cdef SlotStore st
    cdef readonly int32_t num_running
    cdef readonly int32_t num_waiting
    cdef readonly int32_t running_weight
    cdef BlockAllocator _allocator
    cdef int32_t _max_model_len
    cdef dict _slot_of

    # GIL held (may allocate / raise)
    cdef int32_t add(self, int64_t seq_id, const int32_t[::1] prompt, const int32_t[::1] stops,
                     int64_t max_tokens, int32_t num_samples, int64_t cap_tokens,
                     bint skip_cache=*, uint64_t hash_root=*) except -1
    cdef int32_t find(self, int64_t seq_id)
    cdef int apply_step(self, BatchBuilder batch, const int32_t[::1] sampled,
                        int64_t[::1] out_ids, int32_t[::1] out_tokens,
                        int8_t[::1] out_finish) except -1
    cdef int apply_spec_step(self, BatchBuilder batch, const int32_t[:, ::1] sampled,
                             const int32_t[::1] counts, int64_t[::1] out_ids,
                             int32_t[::1] out_tokens, int8_t[::1] out_finish,
                             int32_t[::1] out_index) except -1
    cdef bint finish(self, int64_t seq_id) except -1
    cdef int fork(self, int64_t seq_id, int64_t new_seq_id, int32_t last_token,
                  int32_t max_weight) except -1
    cdef int _fork_groups(self, BatchBuilder batch) except -1
    cdef int32_t _clone_running(self, int32_t p, int64_t new_seq_id) except -1

    # GIL released (errors are negative return codes, see block_allocator.AllocStatus)
    cdef int free_blocks(self, int32_t slot) noexcept nogil
    cdef int take_cached_prefix(self, int32_t slot) noexcept nogil
    cdef void admit(self, int32_t slot) noexcept nogil
    cdef void pop_waiting(self, int32_t k) noexcept nogil
    cdef int preempt_last(self) noexcept nogil
    cdef int _advance_and_append(self, BatchBuilder batch, const int32_t[::1] sampled,
                                 int64_t[::1] out_ids, int32_t[::1] out_tokens,
                                 int8_t[::1] out_finish) noexcept nogil
    cdef int _advance_and_append_spec(self, BatchBuilder batch, const int32_t[:, ::1] sampled,
                                      const int32_t[::1] counts, int64_t[::1] out_ids,
                                      int32_t[::1] out_tokens, int8_t[::1] out_finish,
                                      int32_t[::1] out_index) noexcept nogil
    cdef int _release_finished(self, int32_t slot) noexcept nogil
    cdef void _drop_finished_running(self) noexcept nogil
