"""Incremental detokenization and stop-string matching for one sample.

Method (as vLLM's incremental detokenizer): keep two offsets into the token list. The text of
``ids[prefix_offset:read_offset]`` is already emitted; decoding ``ids[prefix_offset:]`` and
subtracting it gives the new text. Decoding from a few tokens back keeps sentencepiece's
leading spaces (a lone ``▁Once`` decodes to ``Once``, but after ``,`` it is `` Once``), and a
delta ending in U+FFFD (an incomplete multi-byte UTF-8 character split over byte-fallback
tokens) is held back until the character completes.

Stop strings: the last ``max(len(stop)) - 1`` characters are held back while running, so
streamed pieces never contain text that a stop string later removes; the concatenation of all
deltas equals the final text.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output token


class IncrementalDetokenizer:
    """Turns one sample's token stream into text deltas.

    Args:
        tokenizer: the model's transformers tokenizer.
        prompt_ids: the prompt's token ids (context for the first output token's spacing).
        stop: stop strings (excluded from the text).
        skip_special_tokens: drop special tokens (BOS/EOS...) from the text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                 stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded output text (may include held-back characters)
        self.emitted = 0  # characters of self.text already returned as deltas
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> None:
        """Append one generated token; sets :attr:`stop_reason` if a stop string appears."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # nothing new, or an incomplete UTF-8 character: wait for more tokens
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(len(self.text) - self.hold, 0)
        self.text += new
        if self.stop and self.stop_reason is None:
            self._match_stop(start)

    def _match_stop(self, start: int) -> None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self.text = self.text[:best[0]]
            self.stop_reason = best[1]

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while running, the last ``len(stop) - 1`` chars wait."""
        end = len(self.text) if finished or self.stop_reason else len(self.text) - self.hold
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    @property
    def output_text(self) -> str:
        """The text returned so far (what a caller holding all deltas has)."""
        return self.text[:self.emitted]
