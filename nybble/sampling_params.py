"""Sampling parameters, with vLLM's argument names and OpenAI's ranges."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from nybble.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to sample one request's continuation (vLLM-compatible names).

    Args:
        n: number of parallel samples; they share the prompt's KV blocks. ``>= 1``.
        temperature: ``0`` means greedy; ``>= 0``.
        top_p: nucleus mass in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens; ``-1`` (or ``0``) disables.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; ``[0, 1]``.
        seed: per-request seed: the same seed gives the same tokens whatever else is batched.
        max_tokens: maximum number of generated tokens, ``>= 1``.
        stop: strings that end generation; they are not included in the output text.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past the model's EOS ids.
        logprobs: number of top log-probabilities returned per generated token (``None``: none).
        skip_special_tokens: drop special tokens from the detokenized text.

    Raises:
        InvalidRequestError: a value is outside its allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str, value: object) -> InvalidRequestError:
            return InvalidRequestError(f"{name} must be {allowed}, got {value!r}", param=name)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0", self.temperature)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1:
            raise bad("top_k", "-1 (disabled) or >= 1", self.top_k)
        if not 0 <= self.min_p <= 1:  # NOTE: NaN fails every comparison, so it is refused
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", ">= 1", self.max_tokens)
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", ">= 0", self.logprobs)
        if any(not s for s in self.stop_list):
            raise bad("stop", "non-empty strings", self.stop)
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "non-negative token ids", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (``temperature == 0``)."""
        return self.temperature == 0.0
