"""Format the engine's per-token logprobs the way OpenAI's two APIs do.

The engine gives, per generated token, ``{token_id: logprob}`` holding the sampled token and
the top-``k`` tokens (so ``k`` or ``k + 1`` entries). Token strings are decoded against a few
previous tokens, so a SentencePiece word start keeps its leading space (``" Once"``, not
``"Once"``), as the streamed text shows it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nybble.server.responses import (
    ChatLogProbs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)

_CONTEXT = 4   # tokens of left context used to decode one token's string


class TokenDecoder:
    """Decodes token ids to the text piece each adds after a given left context."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def pieces(self, context: Sequence[int], ids: Sequence[int],
               alternatives: Sequence[Sequence[int]] | None = None
               ) -> tuple[list[str], list[dict[int, str]]]:
        """Strings of ``ids`` (decoded in sequence after ``context``) and of each position's
        alternative ids (decoded after the same left context as that position's token).

        Returns:
            ``(pieces, alt_pieces)``: ``pieces[i]`` is the text ``ids[i]`` adds;
            ``alt_pieces[i]`` maps each id of ``alternatives[i]`` to its text.
        """
        window = list(context[-_CONTEXT:])
        pieces: list[str] = []
        alt_pieces: list[dict[int, str]] = []
        for i, tok in enumerate(ids):
            prefix = self._decode(window)
            pieces.append(self._decode(window + [tok])[len(prefix):])
            if alternatives is not None:
                alt_pieces.append({a: (pieces[-1] if a == tok else
                                       self._decode(window + [a])[len(prefix):])
                                   for a in alternatives[i]})
            window = (window + [tok])[-_CONTEXT:]
        return pieces, alt_pieces


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token_id, logprob)`` pairs of one position, best first."""
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def completion_logprobs(decoder: TokenDecoder, context: Sequence[int], ids: Sequence[int],
                        entries: Sequence[dict[int, float]], k: int,
                        text_offset: int) -> CompletionLogProbs:
    """Completions-format logprobs for generated ``ids`` (``entries[i]`` belongs to ``ids[i]``).

    Args:
        context: token ids before ``ids`` (prompt and earlier output).
        k: top-N alternatives per position.
        text_offset: character offset of the first token in the choice's returned text.
    """
    tops = [_top(e, k) for e in entries]
    pieces, alts = decoder.pieces(context, ids, [[t for t, _ in top] for top in tops])
    result = CompletionLogProbs()
    offset = text_offset
    for i, tok in enumerate(ids):
        result.tokens.append(pieces[i])
        result.token_logprobs.append(entries[i].get(tok))
        result.top_logprobs.append({alts[i][t]: lp for t, lp in tops[i]})
        result.text_offset.append(offset)
        offset += len(pieces[i])
    return result


def chat_logprobs(decoder: TokenDecoder, context: Sequence[int], ids: Sequence[int],
                  entries: Sequence[dict[int, float]], k: int) -> ChatLogProbs:
    """Chat-format logprobs (``content``: token, logprob, bytes, top_logprobs) for ``ids``."""
    tops = [_top(e, k) for e in entries]
    pieces, alts = decoder.pieces(context, ids, [[t for t, _ in top] for top in tops])
    content = []
    for i, tok in enumerate(ids):
        top = [TopLogprob(token=alts[i][t], logprob=lp, bytes=list(alts[i][t].encode()))
               for t, lp in tops[i]]
        # NOTE: -9999.0 is OpenAI's stand-in for "-inf" when a logprob is unavailable
        content.append(ChatTokenLogprob(token=pieces[i], logprob=entries[i].get(tok, -9999.0),
                                        bytes=list(pieces[i].encode()), top_logprobs=top))
    return ChatLogProbs(content=content)
