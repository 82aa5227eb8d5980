"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

vLLM's ``prompt_logprobs`` (and the completions API's ``echo`` with ``logprobs``, which
lm-evaluation-harness uses to score multiple-choice answers). The logits at position ``p`` of
a prompt predict token ``p + 1``, so a prefill chunk covering positions ``[s, e)`` yields the
logprobs of prompt tokens ``s + 1 .. min(e, P - 1)``; the chunk's last row predicts the first
token of the next chunk, which this tracker knows because it keeps the prompt. Token 0 has no
logprob (``None`` in the output, as in OpenAI and vLLM).

The model runner asks :meth:`PromptLogprobsTracker.compute` once per step: with no tracked
sequence it returns at once (a request that does not ask costs nothing); otherwise the hidden
rows of every tracked sequence in the batch are gathered, their logits computed in one call,
log-softmaxed in float32 and gathered (the prompt token's own logprob and the top ``k``):
batched over the step, no loop over the vocabulary. A sequence is tracked from admission
until every prompt position has been scored; a position is scored once even if the sequence
is preempted and recomputed (``next_token`` only moves forward).

NOTE: the scheduler must compute every prompt position of such a sequence, so the engine core
adds it with ``skip_prefix_cache`` (vLLM skips the prefix cache for these requests too).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from nybble.runtime.scheduler.batch import ScheduledBatch


@dataclass(slots=True)
class _Tracked:
    prompt: np.ndarray      # int64[P] the prompt's token ids
    k: int                  # top-k alternatives asked for (>= 0)
    next_token: int = 1     # the first prompt token whose logprob is still to come


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Logprobs of prompt tokens ``start .. start + L - 1`` of one sequence (one step's part).

    Attributes:
        seq_id: the sequence (the first of its request).
        start: index in the prompt of the first token scored here (>= 1).
        logprobs: ``float32[L]`` logprob of each prompt token under the raw logits.
        top_token_ids, top_logprobs: ``int64[L, k]`` / ``float32[L, k]`` the ``k`` most likely
            tokens at each position (``k`` = the request's ``prompt_logprobs``; ``k = 0``:
            empty rows).
    """

    seq_id: int
    start: int
    logprobs: np.ndarray
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray


class PromptLogprobsTracker:
    """The sequences whose prompt logprobs are still being computed."""

    def __init__(self) -> None:
        self._seqs: dict[int, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seq_id: int, prompt_token_ids: Iterable[int], k: int) -> None:
        """Track ``seq_id`` (prompt ``P`` tokens, top ``k`` per position). A one-token prompt
        has nothing to score and is not tracked."""
        prompt = np.asarray(list(prompt_token_ids), dtype=np.int64)
        if prompt.shape[0] > 1:
            self._seqs[seq_id] = _Tracked(prompt, int(k))

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Stop tracking finished or aborted sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def _rows(self, batch: ScheduledBatch) -> list[tuple[int, int, int, _Tracked]]:
        """``(seq_id, first flat row, first token scored, count)`` of the tracked sequences
        in ``batch`` that have prompt positions to score this step."""
        found = []
        qsl, positions = batch.query_start_loc, batch.positions
        for b, seq_id in enumerate(batch.seq_ids[:batch.num_seqs].tolist()):
            t = self._seqs.get(seq_id)
            if t is None:
                continue
            row0, row1 = int(qsl[b]), int(qsl[b + 1])
            pos0 = int(positions[row0])
            # positions p in [pos0, pos0 + rows) predict tokens p + 1; only prompt tokens
            # at or after next_token are wanted
            first = max(pos0 + 1, t.next_token)
            last = min(pos0 + (row1 - row0), t.prompt.shape[0] - 1)   # inclusive
            if last >= first:
                found.append((seq_id, row0 + first - 1 - pos0, first, last - first + 1))
        return found

    def compute(self, hidden: torch.Tensor, batch: ScheduledBatch,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]
                ) -> list[PromptLogprobsChunk] | None:
        """Score this step's prompt positions of the tracked sequences.

        Args:
            hidden: ``[T, hidden]`` the step's final hidden states, one row per scheduled
                token (rows of sequence ``b`` at ``query_start_loc[b]..``).
            batch: the step's batch.
            compute_logits: hidden rows ``[R, hidden]`` -> logits ``[R, vocab]``.

        Returns:
            One chunk per sequence scored in this step, or ``None`` when there is none.
        """
        if not self._seqs:
            return None
        found = self._rows(batch)
        if not found:
            return None
        rows = np.concatenate([np.arange(r, r + n) for _, r, _, n in found])
        targets = np.concatenate([self._seqs[s].prompt[f:f + n] for s, _, f, n in found])
        device = hidden.device
        logprobs = compute_logits(hidden.index_select(
            0, torch.from_numpy(rows).to(device))).float().log_softmax(dim=-1)
        chosen = logprobs.gather(1, torch.from_numpy(targets).to(device)[:, None])[:, 0]
        k = max(self._seqs[s].k for s, *_ in found)
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else \
            (logprobs[:, :0], torch.zeros(len(rows), 0, dtype=torch.int64))
        chosen_np, top_lp_np = chosen.cpu().numpy(), top_lp.cpu().numpy()
        top_ids_np = top_ids.cpu().numpy()
        chunks, at = [], 0
        for seq_id, _, first, n in found:
            t = self._seqs[seq_id]
            chunks.append(PromptLogprobsChunk(
                seq_id, first, chosen_np[at:at + n], top_ids_np[at:at + n, :t.k],
                top_lp_np[at:at + n, :t.k]))
            at += n
            t.next_token = first + n
            if t.next_token >= t.prompt.shape[0]:
                del self._seqs[seq_id]
        return chunks
