"""Format the engine's per-token logprobs the way OpenAI's two APIs do.

The engine gives, per generated token, ``{token_id: logprob}`` holding the sampled token and
the top-``k`` tokens (so ``k`` or ``k + 1`` entries). A :class:`SampleDecoder` follows one
sample's tokens in order and gives each token

- its **bytes**: the token's own UTF-8 bytes. A byte-fallback token (``<0x80>``) is that one
  byte (``[128]``), a byte-level BPE token its bytes; other tokens are the text they add after
  a few tokens of left context, so a SentencePiece word start keeps its leading space
  (``" Once"``, not ``"Once"``), as the streamed text shows it;
- its **string**: the characters its bytes complete in the returned text (fed through an
  incremental UTF-8 decoder). A token that ends inside a multi-byte character completes
  none: its string is OpenAI's ``"bytes:\\xe4\\xbd"`` form, and the token that completes the
  character carries it; a token that adds no bytes to the text (SentencePiece's lone word
  start before a newline at the start of a text) is ``""``, so the strings of a sample,
  ``bytes:`` forms left out, concatenate to its text;
- its **text offset**: the index in the returned text of the first character its bytes
  belong to (completions ``text_offset``), so the pieces of a character split over several
  tokens all point at that character.

An echoed prompt (completions ``echo`` with ``logprobs``) is decoded the same way from its
first token, except that its special tokens (BOS), which the echoed text leaves out, keep
their name as their string and add no characters: every ``text_offset`` indexes the echoed
text.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nybble.server.responses import (
    ChatLogProbs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)

CONTEXT_TOKENS = 4
"""Tokens of left context used to decode one token's text."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One token as logprobs show it.

    Attributes:
        token: the characters it completes, or ``"bytes:\\xNN..."`` when it completes none.
        raw: the token's own UTF-8 bytes.
        offset: index in the returned text of the first character its bytes belong to.
    """

    token: str
    raw: bytes
    offset: int


def _label(completed: str, raw: bytes) -> str:
    """A token's string: the characters it completes; ``""`` when it adds no bytes (a
    SentencePiece word start the decoder drops, as the ``"\u2581"`` before a leading newline);
    OpenAI's ``bytes:`` form only for bytes that end inside a character."""
    if completed or not raw:
        return completed
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class SampleDecoder:
    """Turns one sample's generated tokens, in order, into :class:`Piece` objects.

    Args:
        tokenizer: the model's tokenizer (``decode``, ``token_bytes``).
        context: token ids before the first token it will see (the prompt's tail).
        text_offset: characters of the returned text before the first token (the echoed
            prompt's length, else 0).
        hidden: ids of tokens that are not in the returned text (special tokens of an
            echoed prompt): each is labelled with its name and adds no characters.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int], text_offset: int = 0,
                 hidden: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.window = list(context[-CONTEXT_TOKENS:])
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.offset = text_offset
        self.hidden = hidden

    def _raw(self, prefix: str, token_id: int) -> bytes:
        raw = self.tokenizer.token_bytes(token_id)
        if raw is not None:
            return bytes(raw)
        text = str(self.tokenizer.decode(self.window + [token_id], skip_special_tokens=False))
        return text[len(prefix):].encode()

    def _completed(self, raw: bytes) -> str:
        """The characters ``raw`` completes after the bytes consumed so far (no state change)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.setstate(self.utf8.getstate())
        return str(decoder.decode(raw))

    def pieces(self, ids: Sequence[int], alternatives: Sequence[Sequence[int]] | None = None
               ) -> tuple[list[Piece], list[dict[int, Piece]]]:
        """The pieces of ``ids`` (consumed: the next call continues after them) and of each
        position's alternative ids (as if sampled there instead).

        Returns:
            ``(pieces, alt_pieces)``: ``alt_pieces[i]`` maps each id of ``alternatives[i]``
            to its piece (``[]`` without ``alternatives``).
        """
        pieces: list[Piece] = []
        alt_pieces: list[dict[int, Piece]] = []
        for i, tok in enumerate(ids):
            prefix = str(self.tokenizer.decode(self.window, skip_special_tokens=False))
            if alternatives is not None:
                alt = {}
                for a in alternatives[i]:
                    raw = self._raw(prefix, a)
                    alt[a] = Piece(_label(self._completed(raw), raw), raw, self.offset)
                alt_pieces.append(alt)
            if tok in self.hidden:
                name = str(self.tokenizer.decode([tok], skip_special_tokens=False))
                pieces.append(Piece(name, name.encode(), self.offset))
                if alternatives is not None:
                    alt_pieces[-1][tok] = pieces[-1]
                continue
            raw = self._raw(prefix, tok)
            completed = str(self.utf8.decode(raw))
            piece = Piece(_label(completed, raw), raw, self.offset)
            pieces.append(piece)
            if alternatives is not None:
                alt_pieces[-1][tok] = piece
            self.offset += len(completed)
            self.window = (self.window + [tok])[-CONTEXT_TOKENS:]
        return pieces, alt_pieces


def _top(entry: dict[int, float] | None, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token_id, logprob)`` pairs of one position, best first."""
    if entry is None:
        return []
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def completion_logprobs(decoder: SampleDecoder, ids: Sequence[int],
                        entries: Sequence[dict[int, float] | None], k: int,
                        into: CompletionLogProbs | None = None) -> CompletionLogProbs:
    """Completions-format logprobs for the sample's next ``ids``.

    Args:
        decoder: the sample's decoder (it moves past ``ids``).
        entries: ``entries[i]`` belongs to ``ids[i]``; ``None`` (a prompt's first token)
            gives ``null`` logprob and top_logprobs.
        k: top-N alternatives per position.
        into: append to these logprobs (an echoed prompt's) instead of new ones.
    """
    tops = [_top(e, k) for e in entries]
    pieces, alts = decoder.pieces(ids, [[t for t, _ in top] for top in tops])
    result = CompletionLogProbs() if into is None else into
    for i, tok in enumerate(ids):
        entry = entries[i]
        result.tokens.append(pieces[i].token)
        result.token_logprobs.append(None if entry is None else entry.get(tok))
        result.top_logprobs.append(None if entry is None else
                                   {alts[i][t].token: lp for t, lp in tops[i]})
        result.text_offset.append(pieces[i].offset)
    return result


def chat_logprobs(decoder: SampleDecoder, ids: Sequence[int],
                  entries: Sequence[dict[int, float]], k: int) -> ChatLogProbs:
    """Chat-format logprobs (``content``: token, logprob, bytes, top_logprobs) for the
    sample's next generated ``ids``."""
    tops = [_top(e, k) for e in entries]
    pieces, alts = decoder.pieces(ids, [[t for t, _ in top] for top in tops])
    content = []
    for i, tok in enumerate(ids):
        top = [TopLogprob(token=alts[i][t].token, logprob=lp, bytes=list(alts[i][t].raw))
               for t, lp in tops[i]]
        # NOTE: -9999.0 is OpenAI's stand-in for "-inf" when a logprob is unavailable
        content.append(ChatTokenLogprob(token=pieces[i].token,
                                        logprob=entries[i].get(tok, -9999.0),
                                        bytes=list(pieces[i].raw), top_logprobs=top))
    return ChatLogProbs(content=content)
