"""The per-request pieces of :class:`nybble.runtime.sample.logit_shaping.LogitShaping`: the static
additive row of a request, vLLM's bad-word rule, and the layout of a speculative step's
verified positions."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nybble.runtime.messages import EngineCoreRequest

NEG_INF = float("-inf")


def static_row(request: EngineCoreRequest, vocab_size: int,
               device: torch.device) -> torch.Tensor | None:
    """``allowed_token_ids`` (``-inf`` elsewhere), ``logit_bias`` (added; OpenAI) and
    single-token bad words (``-inf``) as one additive ``[vocab_size]`` float32 row on
    ``device``, or ``None`` when the request has none of them."""
    p = request.params
    single = [w[0] for w in request.bad_words_token_ids if len(w) == 1]
    if not (p.logit_bias or p.allowed_token_ids or single):
        return None
    row = torch.zeros(vocab_size)
    if p.allowed_token_ids:
        row.fill_(NEG_INF)
        row[torch.tensor(p.allowed_token_ids, dtype=torch.int64)] = 0.0
    if p.logit_bias:
        ids = torch.tensor([int(k) for k in p.logit_bias], dtype=torch.int64)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
    if single:
        row[torch.tensor(single, dtype=torch.int64)] = NEG_INF
    return row.to(device)


def banned_next(words: Sequence[tuple[tuple[int, ...], int]] | None,
                history: list[int] | None) -> list[int]:
    """The last tokens of the multi-token bad ``words`` (``(prefix, last)``) whose prefix the
    output ``history`` ends with: they cannot come next (vLLM's bad-words rule)."""
    if not words or history is None:
        return []
    return [last for prefix, last in words
            if len(history) >= len(prefix) and tuple(history[len(history) - len(prefix):])
            == prefix]


@dataclass(frozen=True, slots=True)
class VerifyLayout:
    """Where the logits rows of a speculative step sit (see
    :func:`nybble.runtime.sample.rejection_sampler.rejection_sample`): a sample with ``m`` drafts
    owns
    ``m + 1`` consecutive rows, and its row at offset ``j`` is the distribution of the token
    that follows the output so far *and its drafts* ``0 .. j-1``. Shaping that row as
    non-speculative decoding would shape that token therefore counts ``j`` more output tokens
    (``min_tokens``) and sees those drafts in the output history (``bad_words``, penalties).

    Attributes:
        offsets: ``int64[N]`` each logits row's offset ``j`` among its sample's rows.
        drafts: ``int64[N]`` the draft each row judges (the sample's draft ``j``; any value on
            the last, bonus row).
    """

    offsets: np.ndarray
    drafts: np.ndarray

    @classmethod
    def from_num_drafts(cls, num_draft: np.ndarray, drafts: np.ndarray) -> VerifyLayout:
        """The layout of sample rows with ``num_draft[r]`` drafts each (``int[S]``), rows in
        order; ``drafts``: ``int64[sum(num_draft + 1)]``."""
        width = num_draft.astype(np.int64) + 1
        starts = np.repeat(np.cumsum(width) - width, width)
        return cls(np.arange(int(width.sum()), dtype=np.int64) - starts,
                   drafts.astype(np.int64, copy=False))

    def preceding(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The drafts before each of the logits ``rows`` (``int64[R]``) in its sample:
        ``(k, tokens)``, one pair per draft, ``k`` indexing ``rows`` (row ``rows[k]`` at offset
        ``j`` gets its sample's drafts ``0 .. j-1``)."""
        offs = self.offsets[rows]
        k = np.repeat(np.arange(len(rows), dtype=np.int64), offs)
        within = np.arange(len(k), dtype=np.int64) - np.repeat(np.cumsum(offs) - offs, offs)
        return k, self.drafts[np.repeat(rows - offs, offs) + within]

    def history(self, row: int, output: list[int] | None = ()) -> list[int] | None:
        """``output`` (a sequence's recent output tokens; ``None``: none kept) followed by
        the drafts before logits ``row`` in its sample, in order."""
        j = int(self.offsets[row])
        if output is None or not j:
            return output if output is None else list(output)
        return [*output, *self.drafts[row - j:row].tolist()]
