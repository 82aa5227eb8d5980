"""The per-request pieces of :class:`nybble.runtime.logit_shaping.LogitShaping`: the static
additive row of a request and vLLM's bad-word rule."""
from __future__ import annotations

from collections.abc import Sequence

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
