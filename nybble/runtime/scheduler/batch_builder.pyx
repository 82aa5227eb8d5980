# cython: language_level=3
"""The in-flight batch: preallocated output buffers filled once per step (typed Cython, no torch).

The scheduler picks the rows (``add_row``: each sequence with ``num_scheduled`` new tokens) and
records copy-on-write pairs (``add_copy``);
:meth:`BatchBuilder.build` then fills every other buffer with the GIL released, and
:meth:`BatchBuilder.view` wraps the filled prefixes as a :class:`ScheduledBatch` of numpy views
(valid until the next build; the model runner does ``torch.from_numpy`` with no Python loop).
"""
from cpython.mem cimport PyMem_Free
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy, memset

import numpy as np

from nybble.runtime.scheduler.batch import ScheduledBatch

from nybble.runtime.scheduler.sequence cimport (SeqState, SlotStore, block_table_row,
                                                grow_buffer, seq_tokens)


cdef class BatchBuilder:
    """Output buffers of one scheduler step (llama2.c's RunState: allocated once).

    Args:
        max_num_seqs: rows R (sequences per step).
        max_num_batched_tokens: tokens T per step.
        max_blocks_per_seq: block-table width MB (blocks).
        block_size: tokens per KV block.
        speculative: rows may carry draft tokens (fills ``num_draft_tokens`` and the draft
            model's catch-up arrays; off: they are ``None`` and cost nothing).
    """

    def __init__(self, int max_num_seqs, int max_num_batched_tokens, int max_blocks_per_seq,
                 int block_size, bint speculative=False):
        self._block_size = block_size
        self._speculative = speculative
        cdef size_t rows = max_num_seqs * sizeof(int32_t)
        self.row_slots = <int32_t*> grow_buffer(NULL, rows)
        self._row_table_len = <int32_t*> grow_buffer(NULL, rows)
        self.sample_slots = <int32_t*> grow_buffer(NULL, rows)
        self.sample_fork = <int32_t*> grow_buffer(NULL, rows)
        memset(self._row_table_len, 0, rows)
        R, T, MB = max_num_seqs, max_num_batched_tokens, max_blocks_per_seq
        self._input_ids = self._np_input_ids = np.zeros(T, np.int32)
        self._positions = self._np_positions = np.zeros(T, np.int64)
        self._slot_mapping = self._np_slot_mapping = np.zeros(T, np.int64)
        self._block_tables = self._np_block_tables = np.full((R, MB), -1, np.int32)
        self._seq_lens = self._np_seq_lens = np.zeros(R, np.int32)
        self._qsl = self._np_qsl = np.zeros(R + 1, np.int32)
        self.seq_ids = self._np_seq_ids = np.zeros(R, np.int64)
        self._sample_rows = self._np_sample_rows = np.zeros(R, np.int32)
        self.sample_seq_ids = self._np_sample_seq_ids = np.zeros(R, np.int64)
        self._copy_src = self._np_copy_src = np.zeros(R, np.int32)
        self._copy_dst = self._np_copy_dst = np.zeros(R, np.int32)
        self.sample_num_draft = self._np_num_draft = np.zeros(R, np.int32)
        self._prev_ids = self._np_prev_ids = np.zeros(R, np.int32)
        self._prev_slots = self._np_prev_slots = np.zeros(R, np.int64)

    def __dealloc__(self):
        PyMem_Free(self.row_slots)
        PyMem_Free(self._row_table_len)
        PyMem_Free(self.sample_slots)
        PyMem_Free(self.sample_fork)

    cdef void build(self, SlotStore* st) noexcept nogil:
        """Fill the output buffers for the rows in ``row_slots[0:num_rows]`` of store ``st``."""
        cdef int32_t b, j, i, n, start, pos, slot, t = 0, bs = self._block_size
        cdef int32_t* table
        cdef int32_t* tokens
        cdef int32_t* row
        cdef SeqState* s
        self.num_sampled, self._max_q, self._max_sl = 0, 0, 0
        self._qsl[0] = 0
        for b in range(self.num_rows):
            slot = self.row_slots[b]
            s = &st.seqs[slot]
            n, start = s.num_scheduled, s.num_computed
            tokens = seq_tokens(st, s)
            table = block_table_row(st, slot)
            for j in range(n):
                pos = start + j
                self._input_ids[t] = tokens[pos]
                self._positions[t] = pos
                self._slot_mapping[t] = <int64_t> table[pos // bs] * bs + pos % bs
                t += 1
            self._qsl[b + 1] = t
            self._seq_lens[b] = start + n
            self.seq_ids[b] = s.seq_id
            row = &self._block_tables[b, 0]
            memcpy(row, table, s.num_blocks * sizeof(int32_t))
            for j in range(s.num_blocks, self._row_table_len[b]):
                row[j] = -1         # clear what the previous occupant of this row left
            self._row_table_len[b] = s.num_blocks
            self._max_q = max(self._max_q, n)
            self._max_sl = max(self._max_sl, start + n)
            if start + n == s.num_tokens + s.num_spec:
                # NOTE: a row with drafts decodes: it has one sample (groups fork at prefill)
                if s.num_spec > 0:      # speculative decoding: the draft model's catch-up
                    pos = start - 1
                    self._prev_ids[self.num_sampled] = tokens[pos]
                    self._prev_slots[self.num_sampled] = \
                        <int64_t> table[pos // bs] * bs + pos % bs
                for i in range(s.num_samples):
                    if self._speculative:
                        self.sample_num_draft[self.num_sampled] = s.num_spec
                    self._sample_rows[self.num_sampled] = t - 1
                    self.sample_seq_ids[self.num_sampled] = s.seq_id + i
                    self.sample_slots[self.num_sampled] = slot
                    self.sample_fork[self.num_sampled] = i
                    self.num_sampled += 1
        self.num_tokens = t

    cdef object view(self):
        """ScheduledBatch of numpy views of the filled prefixes (valid until the next build)."""
        B, T, S, C = self.num_rows, self.num_tokens, self.num_sampled, self.num_copies
        return ScheduledBatch(
            num_seqs=B, num_tokens=T, max_query_len=self._max_q, max_seq_len=self._max_sl,
            input_ids=self._np_input_ids[:T], positions=self._np_positions[:T],
            slot_mapping=self._np_slot_mapping[:T], block_tables=self._np_block_tables[:B],
            seq_lens=self._np_seq_lens[:B], query_start_loc=self._np_qsl[:B + 1],
            seq_ids=self._np_seq_ids[:B], sample_rows=self._np_sample_rows[:S],
            sample_seq_ids=self._np_sample_seq_ids[:S], copy_src=self._np_copy_src[:C],
            copy_dst=self._np_copy_dst[:C],
            num_draft_tokens=self._np_num_draft[:S] if self._speculative else None,
            draft_prev_ids=self._np_prev_ids[:S] if self._speculative else None,
            draft_prev_slots=self._np_prev_slots[:S] if self._speculative else None)
