# cython: language_level=3
"""C-level declarations of the in-flight batch buffers (rules in batch_builder.pyx)."""
from libc.stdint cimport int32_t, int64_t

from nybble.runtime.sequence cimport SeqStore


cdef class BatchBuilder:
    cdef:
        # ---- sizes of the in-flight batch (rows <= max_num_seqs) --------------------------
        # field                 type       meaning (units)
        # --------------------  ---------  ----------------------------------------------------
        # _block_size           int32      tokens per KV block
        # _nb/_nt/_ns/_nc       int32      rows, tokens, sample rows, copy pairs
        # _max_q/_max_sl        int32      max query length / max seq length (tokens)
        # _row_slots            int32[R]   slot of each batch row (the scheduler appends)
        # _row_table_len        int32[R]   valid block-table entries written to row r last time
        # _sample_slots         int32[R]   slot of each sample row (-1: sibling not forked yet)
        # _sample_fork          int32[R]   i for sample row seq_id+i of a group (0: no fork)
        int32_t _block_size
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

    cdef void build(self, SeqStore* st) noexcept nogil
    cdef object view(self)
