"""The draft model of speculative decoding: its paged KV cache and its batched proposals.

NOTE: the draft's KV cache shares the target's block tables and slot mapping. It has the
same number of blocks and the same block size as the target's (its own geometry: layers,
KV heads, head dim), and the draft computes exactly the token positions the target computes,
so the slot the scheduler gives a token holds the target's K/V in the target's cache and the
draft's K/V in the draft's: one allocation (one ``BlockAllocator``, one block table per
sequence, the same copy-on-write pairs, the same prefix-cache hits and preemptions) covers
both, and freeing a sequence's blocks frees both. A separate allocator would take the same
decisions at every step, twice.

Per step (:meth:`DraftProposer.propose`), all in batched forwards of the draft model:

1. one forward over every row: a row without drafts feeds the draft the target's tokens of
   the step (prefill chunks, recompute after preemption, plain decode), so the draft's cache
   follows the target's; a row with ``m`` drafts feeds its last token, preceded by the token
   before it when the sequence's previous proposal was accepted whole (its last draft was
   then never fed to the draft: :meth:`DraftProposer.note_verified` tracks those sequences).
   When every row feeds one token this is a decode forward (the fast decode kernel). The
   draft's argmax at the last token is the first proposal;
2. ``max m - 1`` decode forwards over the rows that still need proposals, each feeding the
   previous proposal at its position and slot.

NOTE: the draft's cache may miss one position of a sequence (its proposal was accepted whole
and its next step had no drafts; or a prefix-cache hit on a block whose last position was
such a draft): that can lower the acceptance rate, never change the output, which the
target's verification alone decides.

Proposals are the draft's argmax (a one-hot proposal distribution, see
:mod:`nybble.runtime.sample.rejection_sampler`); they are written into the batch's ``input_ids`` at
the draft positions, which the target then verifies.
"""
from __future__ import annotations

import numpy as np
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.models.loader import LoadedModel
from nybble.runtime.sample.sampler import row_argmax
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.worker.kv_cache import allocate_kv_cache
from nybble.runtime.worker.kv_plan import KVCacheSpec


def _metadata(slots: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray,
              block_tables: np.ndarray, device: torch.device) -> AttentionMetadata:
    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
    q = np.diff(qsl)
    return AttentionMetadata(
        slot_mapping=t(slots, torch.int64), query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32), block_tables=t(block_tables, torch.int32),
        max_query_len=int(q.max()), max_seq_len=int(seq_lens.max()),
        is_decode_only=bool((q == 1).all()))


def decode_rows_metadata(slots: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
                         row_of_token: np.ndarray, device: torch.device) -> AttentionMetadata:
    """Metadata that runs a varlen batch of short rows as one decode row per token.

    Token ``t`` (position ``p``, row ``row_of_token[t]``) becomes a decode row whose sequence
    is its row's first ``p + 1`` tokens: every layer writes the K/V of all tokens before it
    attends, so the row sees exactly the keys causal attention allows. The backend's decode
    kernel then verifies the ``m + 1`` positions of a speculative row, as it computes a plain
    decode position (the same arithmetic as without speculation).
    """
    return _metadata(slots, np.arange(len(positions) + 1, dtype=np.int32),
                     (positions + 1).astype(np.int32), block_tables[row_of_token], device)


class DraftProposer:
    """The draft model and its KV cache (see the module docstring).

    Args:
        loaded: the loaded draft model (same vocabulary as the target).
        target_spec: the target's KV pool: the draft's has its block count and block size.
        device: where both models run.
    """

    def __init__(self, loaded: LoadedModel, target_spec: KVCacheSpec,
                 device: torch.device) -> None:
        shape = loaded.shape
        self.model = loaded.model
        self.device = device
        self.spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                loaded.dtype, target_spec.block_size, target_spec.num_blocks)
        self.kv_caches = allocate_kv_cache(self.spec, device)
        # sequences whose last accepted draft the draft model has not fed yet
        self.lagging: set[int] = set()

    def note_verified(self, seq_ids: np.ndarray, num_draft: np.ndarray,
                      counts: np.ndarray) -> None:
        """After a step: sample row ``r`` (sequence ``seq_ids[r]``) had ``num_draft[r]``
        drafts and emitted ``counts[r]`` tokens; a proposal accepted whole leaves the
        sequence lagging by one fed token."""
        whole = (num_draft > 0) & (counts == num_draft + 1)
        self.lagging.difference_update(seq_ids[~whole].tolist())
        self.lagging.update(seq_ids[whole].tolist())

    def forget(self, seq_ids) -> None:
        """Drop finished or aborted sequences."""
        self.lagging.difference_update(seq_ids)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write in the draft's cache too (the same pairs as the target's)."""
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    def _argmax(self, ids: np.ndarray, pos: np.ndarray, meta: AttentionMetadata,
                rows: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(ids)).to(self.device)
        p = torch.from_numpy(np.ascontiguousarray(pos)).to(self.device)
        hidden = self.model(t, p, self.kv_caches, meta)
        if not len(rows):
            return np.zeros(0, np.int32)
        index = torch.from_numpy(rows.astype(np.int64)).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return row_argmax(logits).to(torch.int32).cpu().numpy()

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Run the draft over ``batch`` and write its proposals into ``batch.input_ids``
        (see the module docstring)."""
        qsl = batch.query_start_loc
        starts, qlen = qsl[:-1], np.diff(qsl)
        m_row = np.zeros(batch.num_seqs, np.int32)
        prev_ids = np.zeros(batch.num_seqs, np.int32)
        prev_slots = np.zeros(batch.num_seqs, np.int64)
        spec = np.flatnonzero(batch.num_draft_tokens)
        rows = np.searchsorted(qsl, batch.sample_rows[spec] + 1) - 1
        m_row[rows] = batch.num_draft_tokens[spec]
        prev_ids[rows], prev_slots[rows] = batch.draft_prev_ids[spec], batch.draft_prev_slots[spec]
        is_spec = m_row > 0
        # NOTE: feeding the token before the last again is always correct (same token, same
        # prefix); it is needed only where the previous proposal was accepted whole
        lagging = np.zeros(batch.num_seqs, bool)
        if self.lagging:
            lagging[rows] = np.isin(batch.sample_seq_ids[spec], list(self.lagging))
        # 1. one forward: a spec row feeds [token before the last if lagging, last token]
        new_len = np.where(is_spec, 1 + lagging, qlen)
        new_qsl = np.zeros(batch.num_seqs + 1, np.int32)
        np.cumsum(new_len, out=new_qsl[1:])
        rel = np.arange(new_qsl[-1]) - np.repeat(new_qsl[:-1], new_len)
        src = np.repeat(starts, new_len) + rel - np.repeat(lagging, new_len)
        ids, pos = batch.input_ids[src], batch.positions[src].copy()
        slots = batch.slot_mapping[src].copy()
        prev = np.repeat(lagging, new_len) & (rel == 0)
        first = starts[lagging]
        ids[prev], pos[prev], slots[prev] = prev_ids[lagging], batch.positions[first] - 1, \
            prev_slots[lagging]
        if new_len.max() <= 2:      # decode rows only: one decode row per token
            meta = decode_rows_metadata(slots, pos, batch.block_tables,
                                        np.repeat(np.arange(batch.num_seqs), new_len),
                                        self.device)
        else:
            seq_lens = np.where(is_spec, batch.positions[starts] + 1, batch.seq_lens)
            meta = _metadata(slots, new_qsl, seq_lens, batch.block_tables, self.device)
        spec_rows = np.flatnonzero(is_spec)
        if not len(spec_rows):
            self._argmax(ids, pos, meta, np.zeros(0, np.int64))
            return
        proposal = self._argmax(ids, pos, meta, new_qsl[spec_rows + 1] - 1)
        batch.input_ids[starts[spec_rows] + 1] = proposal
        # 2. decode forwards over the rows that still need proposals
        for j in range(1, int(m_row.max())):
            keep = m_row[spec_rows] > j
            spec_rows, proposal = spec_rows[keep], proposal[keep]
            flat = starts[spec_rows] + j
            n = len(spec_rows)
            meta = _metadata(batch.slot_mapping[flat], np.arange(n + 1, dtype=np.int32),
                             batch.positions[flat].astype(np.int32) + 1,
                             batch.block_tables[spec_rows], self.device)
            proposal = self._argmax(proposal, batch.positions[flat], meta,
                                    np.arange(n))
            batch.input_ids[flat + 1] = proposal
