# cython: language_level=3
"""C-level declarations of the sequence manager (rules in seq_manager.pyx)."""
from libc.stdint cimport int8_t, int32_t, int64_t

from nybble.runtime.batch_builder cimport BatchBuilder
from nybble.runtime.block_allocator cimport BlockAllocator
from nybble.runtime.sequence cimport SeqState, SeqStore


cdef class SeqManager:
    cdef:
        # ---- configuration (fixed at construction by the Scheduler) -------------------------
        # field                 type       meaning (units)
        # --------------------  ---------  ----------------------------------------------------
        # _block_size           int32      tokens per KV block
        # _max_model_len        int32      context limit L (tokens)
        # _max_blocks_per_seq   int32      MB = ceil(L / block_size), block-table width (blocks)
        # _alloc                BlockAllocator  the KV block pool
        int32_t _block_size
        int32_t _max_model_len
        int32_t _max_blocks_per_seq
        BlockAllocator _alloc

        # ---- sequences ----------------------------------------------------------------------
        # _st                   SeqStore   slots, block tables, token arena, queue storage
        # _slot_of              dict       seq_id -> slot (Python; add/finish/fork only)
        SeqStore _st
        dict _slot_of

        # ---- queues (slots) -----------------------------------------------------------------
        # _st.running[0:_num_running]   slots in admission order, oldest first
        # _st.waiting[0:_num_waiting]   slots FCFS, front = index 0 (preempted go to the front)
        # _running_weight       int32      sum of num_samples over running (<= max_num_seqs)
        # _num_preemptions      int64      total preemptions since construction
        # _prefix_hits          int64      tokens found in the prefix cache on admission
        # _prefix_queries       int64      tokens of the sequences admitted with caching on
        int32_t _num_running
        int32_t _running_weight
        int32_t _num_waiting
        int64_t _num_preemptions
        int64_t _prefix_hits
        int64_t _prefix_queries

        # ---- the in-flight batch ------------------------------------------------------------
        # _batch                BatchBuilder  rows, sample rows, copy pairs, output buffers
        # _inflight             object     the ScheduledBatch awaiting update(), or None
        BatchBuilder _batch
        object _inflight

    # GIL held (may allocate / raise)
    cdef int32_t _new_slot(self, int64_t seq_id, int64_t num_stop, int64_t cap) except -1
    cdef int _fork_groups(self) except -1

    # GIL released (errors are negative return codes, see block_allocator.AllocStatus)
    cdef int _free_blocks(self, int32_t slot) noexcept nogil
    cdef void _cache_full_blocks(self, SeqState* s, int32_t slot) noexcept nogil
    cdef int _c_update(self, const int32_t[::1] sampled, int64_t[::1] out_ids,
                       int32_t[::1] out_tokens, int8_t[::1] out_finish) noexcept nogil
