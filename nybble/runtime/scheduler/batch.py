"""ScheduledBatch: what the scheduler hands the model runner for one step (numpy, no torch).

Every array is a VIEW into a buffer the scheduler preallocated once; it stays valid until the
next ``Scheduler.schedule()`` call, which overwrites the buffers. The model runner converts
each array with ``torch.from_numpy`` (no Python loop) before that.

Shapes (B = num_seqs, T = num_tokens, S = sampled rows, C = copy-on-write pairs,
MB = ceil(max_model_len / block_size))::

    input_ids       int32[T]      token ids of the scheduled tokens, rows of sequence b are
                                  query_start_loc[b] .. query_start_loc[b+1]-1
    positions       int64[T]      position of each token in its sequence (tokens)
    slot_mapping    int64[T]      KV slot = block_tables[b, pos // block_size] * block_size
                                  + pos % block_size
    block_tables    int32[B, MB]  block ids per sequence, padding -1
    seq_lens        int32[B]      tokens in the cache after this step (computed + new)
    query_start_loc int32[B+1]    cumulative new-token counts, query_start_loc[0] = 0
    seq_ids         int64[B]      sequence id of each row
    sample_rows     int32[S]      flat token rows whose logits are sampled
    sample_seq_ids  int64[S]      sequence id each sampled token belongs to
    copy_src        int32[C]      copy KV block copy_src[i] -> copy_dst[i] before the forward
    copy_dst        int32[C]
    num_draft_tokens int32[S]     speculative decoding: draft tokens m of sample row r; its
                                  m + 1 verified rows are sample_rows[r] - m .. sample_rows[r]
                                  (the row's last token, then the drafts)
    draft_prev_ids  int32[S]      where m > 0: the token before the row's last one, and its
    draft_prev_slots int64[S]     KV slot (a draft model rewrites it; see model_runner)

The last three are ``None`` unless the scheduler was built for speculative decoding
(``num_lookahead_slots > 0``; never from the reference scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One scheduler step's work, as numpy views (see the module docstring for shapes).

    Attributes:
        num_seqs: rows B (sequences scheduled this step); 0 means nothing to run.
        num_tokens: flat tokens T scheduled this step (<= max_num_batched_tokens).
        max_query_len: largest number of new tokens of one row (tokens).
        max_seq_len: largest seq_lens entry (tokens).
    """

    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    seq_ids: np.ndarray
    sample_rows: np.ndarray
    sample_seq_ids: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    num_draft_tokens: np.ndarray | None = None
    draft_prev_ids: np.ndarray | None = None
    draft_prev_slots: np.ndarray | None = None

    @property
    def num_sampled(self) -> int:
        """Rows S whose logits are sampled this step (len of ``sampled`` for update())."""
        return int(self.sample_rows.shape[0])
