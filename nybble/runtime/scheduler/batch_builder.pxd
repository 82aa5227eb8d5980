# cython: language_level=3
"""C-level declarations of the in-flight batch buffers (rules in batch_builder.pyx).

Public C surface for the scheduler:

* ``reset`` / ``add_row`` / ``add_copy``: what the scheduler appends while it picks the step;
* ``build`` (fills every buffer from the rows) and ``view`` (the ScheduledBatch);
* read by ``Scheduler.update``: the readonly sizes, ``row_slots``/``seq_ids`` (one per row)
  and ``sample_slots``/``sample_fork``/``sample_seq_ids`` (one per sample row);
  ``set_sample_slot`` points a sample row at the sibling that update() forked for it.

Every field with a leading underscore is private to this class.
"""
from libc.stdint cimport int32_t, int64_t

from nybble.runtime.scheduler.sequence cimport SlotStore


cdef class BatchBuilder:
    # ---- public -------------------------------------------------------------------------------
    # field          type        meaning (units)
    # -------------  ----------  ----------------------------------------------------------------
    # num_rows       int32       rows B of the in-flight batch (<= max_num_seqs)   (readonly)
    # num_tokens     int32       flat tokens T                                     (readonly)
    # num_sampled    int32       sample rows S                                     (readonly)
    # num_copies     int32       copy-on-write pairs C                             (readonly)
    # row_slots      int32[R]    sequence slot of each row (add_row appends)
    # seq_ids        int64[R]    seq_id of each row (build fills)
    # sample_slots   int32[R]    slot each sample row's token goes to (-1: none)
    # sample_fork    int32[R]    i for sample row seq_id+i of a group (0: no fork)
    # sample_seq_ids int64[R]    seq_id of each sample row
    # sample_num_draft int32[R]  speculative decoding: draft tokens of each sample row
    cdef readonly int32_t num_rows
    cdef readonly int32_t num_tokens
    cdef readonly int32_t num_sampled
    cdef readonly int32_t num_copies
    cdef int32_t* row_slots
    cdef int32_t* sample_slots
    cdef int32_t* sample_fork
    cdef int64_t[::1] seq_ids
    cdef int64_t[::1] sample_seq_ids
    cdef int32_t[::1] sample_num_draft

    # ---- private ------------------------------------------------------------------------------
    # _block_size     int32     tokens per KV block
    # _max_q/_max_sl  int32     max query length / max seq length of the batch (tokens)
    # _row_table_len  int32[R]  valid block-table entries written to row r last time
    cdef int32_t _block_size
    cdef bint _speculative                # rows may carry drafts (fill the spec arrays)
    cdef int32_t _max_q
    cdef int32_t _max_sl
    cdef int32_t* _row_table_len

    # preallocated output buffers (numpy arrays and typed views of them)
    cdef object _np_input_ids, _np_positions, _np_slot_mapping, _np_block_tables, _np_seq_lens
    cdef object _np_qsl, _np_seq_ids, _np_sample_rows, _np_sample_seq_ids, _np_copy_src
    cdef object _np_copy_dst, _np_num_draft, _np_prev_ids, _np_prev_slots
    cdef int32_t[::1] _input_ids          # [max_batched] token ids
    cdef int64_t[::1] _positions          # [max_batched] positions (tokens)
    cdef int64_t[::1] _slot_mapping       # [max_batched] block_id * block_size + offset
    cdef int32_t[:, ::1] _block_tables    # [max_num_seqs, MB] padding -1
    cdef int32_t[::1] _seq_lens           # [max_num_seqs] computed + new (tokens)
    cdef int32_t[::1] _qsl                # [max_num_seqs + 1] query_start_loc
    cdef int32_t[::1] _sample_rows        # [max_num_seqs] flat token rows to sample
    cdef int32_t[::1] _copy_src           # [max_num_seqs] copy-on-write source blocks
    cdef int32_t[::1] _copy_dst           # [max_num_seqs] copy-on-write destination blocks
    cdef int32_t[::1] _prev_ids           # [max_num_seqs] token before the last (spec rows)
    cdef int64_t[::1] _prev_slots         # [max_num_seqs] its KV slot (spec rows)

    cdef inline void reset(self) noexcept nogil:
        """Start a step: no rows, no copies."""
        self.num_rows = self.num_copies = 0

    cdef inline void add_row(self, int32_t slot) noexcept nogil:
        """Append the sequence in ``slot`` (its ``num_scheduled`` tokens) as the next row."""
        self.row_slots[self.num_rows] = slot
        self.num_rows += 1

    cdef inline void add_copy(self, int32_t src, int32_t dst) noexcept nogil:
        """Record a copy-on-write of KV block ``src`` into ``dst`` (before the forward)."""
        self._copy_src[self.num_copies] = src
        self._copy_dst[self.num_copies] = dst
        self.num_copies += 1

    cdef inline void set_sample_slot(self, int32_t r, int32_t slot) noexcept nogil:
        """Send sample row ``r``'s token to ``slot`` (a forked sibling; -1: nobody)."""
        self.sample_slots[r] = slot

    cdef void build(self, SlotStore* st) noexcept nogil
    cdef object view(self)
