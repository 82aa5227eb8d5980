# cython: language_level=3
"""C-level declarations of the continuous-batching scheduler (rules in scheduler.pyx)."""
from libc.stdint cimport int8_t, int32_t, int64_t

from nybble.runtime.block_allocator cimport BlockAllocator
from nybble.runtime.sequence cimport SeqStore


cdef class Scheduler:
    cdef:
        # ---- configuration (fixed at construction) -----------------------------------------
        # field                 type       meaning (units)
        # --------------------  ---------  ----------------------------------------------------
        # _block_size           int32      tokens per KV block
        # _max_num_seqs         int32      cap on running sequences (a group counts num_samples)
        # _max_batched          int32      token budget per step (tokens)
        # _max_model_len        int32      context limit L (tokens)
        # _max_blocks_per_seq   int32      MB = ceil(L / block_size), block-table width (blocks)
        # _chunked              bint       enable_chunked_prefill
        int32_t _block_size
        int32_t _max_num_seqs
        int32_t _max_batched
        int32_t _max_model_len
        int32_t _max_blocks_per_seq
        bint _chunked
        BlockAllocator _alloc

        # ---- sequences ----------------------------------------------------------------------
        # _st                   SeqStore   slots, block tables, token arena, queue storage
        # _slot_of              dict       seq_id -> slot (Python; add/finish/fork only)
        SeqStore _st
        dict _slot_of

        # ---- queues (slots) -----------------------------------------------------------------
        # _st.running[0:_num_running]   slots in admission order, oldest first
        # _st.waiting[0:_num_waiting]   slots FCFS, front = index 0 (preempted go to the front)
        # _running_weight       int32      sum of num_samples over running (<= _max_num_seqs)
        # _num_preemptions      int64      total preemptions since construction
        int32_t _num_running
        int32_t _running_weight
        int32_t _num_waiting
        int64_t _num_preemptions

        # ---- the in-flight batch (sizes; rows <= _max_num_seqs) -----------------------------
        # _nb/_nt/_ns/_nc       int32      rows, tokens, sample rows, copy pairs
        # _max_q/_max_sl        int32      max query length / max seq length (tokens)
        # _row_slots            int32[R]   slot of each batch row
        # _row_table_len        int32[R]   valid block-table entries written to row r last time
        # _sample_slots         int32[R]   slot of each sample row (-1: sibling not forked yet)
        # _sample_fork          int32[R]   i for sample row seq_id+i of a group (0: no fork)
        # _inflight             object     the ScheduledBatch awaiting update(), or None
        int32_t _nb
        int32_t _nt
        int32_t _ns
        int32_t _nc
        int32_t _max_q
        int32_t _max_sl
        int32_t* _row_slots
        int32_t* _row_table_len
        int32_t* _sample_slots
        int32_t* _sample_fork
        object _inflight

        # ---- preallocated output buffers (numpy arrays and typed views of them) -------------
        object _np_input_ids, _np_positions, _np_slot_mapping, _np_block_tables, _np_seq_lens
        object _np_qsl, _np_seq_ids, _np_sample_rows, _np_sample_seq_ids, _np_copy_src
        object _np_copy_dst
        int32_t[::1] _input_ids          # [max_batched] token ids
        int64_t[::1] _positions          # [max_batched] positions (tokens)
        int64_t[::1] _slot_mapping       # [max_batched] block_id * block_size + offset
        int32_t[:, ::1] _block_tables    # [max_num_seqs, MB] padding -1
        int32_t[::1] _seq_lens           # [max_num_seqs] computed + new (tokens)
        int32_t[::1] _qsl                # [max_num_seqs + 1] query_start_loc
        int64_t[::1] _seq_ids            # [max_num_seqs]
        int32_t[::1] _sample_rows        # [max_num_seqs] flat token rows to sample
        int64_t[::1] _sample_seq_ids     # [max_num_seqs]
        int32_t[::1] _copy_src           # [max_num_seqs] copy-on-write source blocks
        int32_t[::1] _copy_dst           # [max_num_seqs] copy-on-write destination blocks

    # GIL held (may allocate / raise)
    cdef int32_t _new_slot(self, int64_t seq_id, int64_t num_stop, int64_t cap) except -1
    cdef int _fork_groups(self) except -1

    # GIL released (errors are negative return codes, see block_allocator.AllocStatus)
    cdef int _free_blocks(self, int32_t slot) noexcept nogil
    cdef int _allocate_for(self, int32_t slot, int32_t n) noexcept nogil
    cdef int _preempt_last(self) noexcept nogil
    cdef int _schedule_running(self, int32_t* budget) noexcept nogil
    cdef int _schedule_waiting(self, int32_t* budget) noexcept nogil
    cdef void _build_batch(self) noexcept nogil
    cdef int _c_update(self, const int32_t[::1] sampled, int64_t[::1] out_ids,
                       int32_t[::1] out_tokens, int8_t[::1] out_finish) noexcept nogil
