"""Incremental detokenization and stop-string matching for one sample.

Method: the ``tokenizers`` library's streaming decoder (``DecodeStream``), primed with the
last few prompt tokens, turns each new token into the text it adds after what came before,
in O(1) work per token (it re-decodes only a short window, not the whole output). Priming
keeps sentencepiece's leading spaces (a lone ``▁Once`` decodes to ``Once``, but after ``,``
it is `` Once``); a token that ends inside a multi-byte UTF-8 character (byte-fallback
tokens) yields nothing until the character completes, so no piece holds half a character.

Stop strings: none ends the text before the sample has more than ``min_tokens`` tokens (a stop
string completed by one of the first ``min_tokens`` tokens is not a stop; vLLM's rule, the
same bound as for stop token ids). The last ``max(len(stop)) - 1`` characters are held back
while running, so streamed pieces never contain text that a stop string later removes; the concatenation of all
deltas equals the final text.
"""
from __future__ import annotations

from collections.abc import Sequence

from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens that prime the stream (leading-space context)


class IncrementalDetokenizer:
    """Turns one sample's token stream into text deltas.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt's token ids (context for the first output token's spacing).
        params: the sample's parameters: ``stop`` strings (excluded from the text unless
            ``include_stop_str_in_output``), ``skip_special_tokens`` (drop BOS/EOS...)
            and ``spaces_between_special_tokens``; stop strings are matched only from
            output token ``min_tokens + 1`` on.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self._stream = tokenizer.text_stream(prompt_ids[-_PROMPT_CONTEXT_TOKENS:],
                                             params.skip_special_tokens,
                                             params.spaces_between_special_tokens)
        self.stop = params.stop_list
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded output text (may include held-back characters)
        self.emitted = 0  # characters of self.text already returned as deltas
        self.stop_reason: str | None = None
        self.min_tokens = params.min_tokens
        self.num_tokens = 0  # output tokens added

    def add_token(self, token_id: int) -> None:
        """Append one generated token; sets :attr:`stop_reason` if a stop string appears
        (tokens after that are ignored)."""
        if self.stop_reason is not None:
            return
        self.num_tokens += 1
        new = self._stream.step(token_id)
        if not new:
            return  # nothing new, or an incomplete UTF-8 character: wait for more tokens
        start = max(len(self.text) - self.hold, 0)
        self.text += new
        if self.stop and self.num_tokens > self.min_tokens:
            self._match_stop(start)

    def _match_stop(self, start: int) -> None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self.text = self.text[:best[0] + (len(best[1]) if self.include_stop else 0)]
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
