"""Sampling parameters, with vLLM's argument names and OpenAI's ranges.

``SamplingParams`` only carries values (and normalises their spelling); every range is checked
once, by the request gate (:mod:`nybble.runtime.input_processor`), when the request enters
the engine, and ``max_tokens=None`` is resolved there too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SAMPLE_SEED_STRIDE = 1_000_003
"""Sample ``i`` of a request with ``seed`` draws from a generator seeded
``(seed + i * stride) mod 2**64``."""

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
"""The seeds a request may carry: a signed or an unsigned 64-bit integer (what a
``torch.Generator`` accepts; a negative seed ``s`` is the same generator as ``s + 2**64``).
``-1`` is not a seed: it means "no seed" (vLLM's convention)."""

NO_SEED = -1
"""The ``seed`` value that means "no seed" (as if ``seed`` were ``None``)."""


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample ``index`` of a request seeded ``seed``: in
    ``[0, 2**64)`` for every seed in ``[SEED_MIN, SEED_MAX]`` and every index (it wraps
    around instead of overflowing; sample 0's generator is the one ``seed`` itself gives).

    NOTE: each sample gets its own stream, so the ``n`` samples of one request differ.
    """
    return (seed + index * SAMPLE_SEED_STRIDE) % (1 << 64)


@dataclass
class SamplingParams:
    """How to sample one request's continuation (vLLM-compatible names).

    The allowed values (checked by the request gate, ``InvalidRequestError`` naming the
    parameter otherwise):

    Args:
        n: number of parallel samples; they share the prompt's KV blocks.
            ``1 <= n <= max_num_seqs``.
        temperature: ``0`` means greedy; finite and ``>= 0``.
        top_p: nucleus mass in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens; ``-1`` (or ``0``) disables; else ``>= 1``.
        min_p: drop tokens whose probability is below ``min_p * max_prob``; ``[0, 1]``.
        seed: per-request seed for reproducible sampling: an integer in
            ``[-2**63, 2**64 - 1]`` (:data:`SEED_MIN`, :data:`SEED_MAX`), or ``None``; ``-1``
            means no seed. Sample ``i`` of ``n`` draws from its own generator
            (:func:`sample_seed`), so the random draws do not depend on what else is
            batched. The probabilities they pick from can, in the last bits: see
            docs/serving.md ("Seeds and batching") for when the same seed can give a
            different continuation.
        max_tokens: maximum number of generated tokens, ``>= 0``; ``None``: the rest of the
            context (``max_model_len`` minus the prompt). Prompt + ``max_tokens`` must fit
            in ``max_model_len``. ``0`` generates nothing (every sample ends empty with
            ``finish_reason`` ``"length"``): with ``prompt_logprobs``, scoring a prompt,
            which may then fill the whole context.
        stop: strings that end generation; they are not included in the output text.
            Non-empty strings.
        stop_token_ids: token ids that end generation (kept in ``token_ids``); ids of the
            vocabulary.
        ignore_eos: keep generating past the model's EOS ids.
        logprobs: number of top log-probabilities returned per generated token (``None``:
            none); ``0 <= logprobs <= min(max_logprobs, vocabulary size)``.
        prompt_logprobs: number of top log-probabilities returned per prompt token (``None``:
            none; ``0``: only the prompt token's own), in ``RequestOutput.prompt_logprobs``;
            same range as ``logprobs``. Such a request skips the prefix cache (every prompt
            position must be computed), as in vLLM.
        best_of: generate ``best_of`` samples and return the ``n`` with the highest
            cumulative logprob (OpenAI/vLLM); ``None`` means ``n``; ``n <= best_of <=
            max_num_seqs``.
        skip_special_tokens: drop special tokens from the detokenized text.
        spaces_between_special_tokens: with ``skip_special_tokens=False``, put a space
            between a special token and the text next to it (vLLM's option, the rule of
            transformers' slow tokenizers).
        include_stop_str_in_output: keep the stop string that ended a sample at the end of
            its text.
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
    prompt_logprobs: int | None = None
    best_of: int | None = None
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if type(self.seed) is int and self.seed == NO_SEED:
            self.seed = None

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: ``best_of``, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (``temperature == 0``)."""
        return self.temperature == 0.0
