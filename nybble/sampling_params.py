"""Sampling parameters, with vLLM's argument names and OpenAI's ranges.

``SamplingParams`` only carries values (and normalises their spelling); every range is checked
once, by the request gate (:mod:`nybble.runtime.frontend.input_processor`), when the request enters
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
class GuidedDecodingParams:
    """Structured output: the one constraint a request's output must follow (vLLM's names).

    Exactly one field is set (the request gate checks it).

    Args:
        json: a JSON schema (as JSON text or a dict; the gate stores it as text).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False

    def kind(self) -> list[str]:
        """The names of the fields that are set."""
        return [k for k, v in (("json", self.json), ("regex", self.regex),
                               ("choice", self.choice), ("json_object", self.json_object))
                if v is not None and v is not False]


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
        use_beam_search: beam search instead of sampling (vLLM's extra parameter): the
            ``n`` best of ``beam_width`` beams are returned, best first. Needs
            ``temperature == 0``, no ``logprobs`` and no ``stop`` strings; EOS and
            ``stop_token_ids`` end a beam. Semantics: docs/serving.md ("Beam search").
        beam_width: beams kept per step, ``n <= beam_width <= max_num_seqs``; ``None``:
            ``n``.
        length_penalty: beam search: a finished beam scores ``cumulative_logprob /
            generated_len ** length_penalty`` (finite; transformers' semantics).
        early_stopping: beam search: ``True`` (stop once ``beam_width`` beams finished),
            ``False`` (stop when the best live beam cannot beat them, scored at the current
            length) or ``"never"`` (the same, scored at ``max_tokens`` when
            ``length_penalty > 0``); transformers' semantics.
        logit_bias: ``{token id: bias}`` added to the logits before sampling (OpenAI's
            semantics); ids of the vocabulary, biases in ``[-100, 100]``.
        min_tokens: the first ``min_tokens`` generated tokens cannot be EOS, a
            ``stop_token_ids`` id, or end a stop string; ``0 <= min_tokens <= max_tokens``.
        repetition_penalty: divides the positive logits (multiplies the negative ones) of
            every token seen in the prompt or the output (Keskar et al. 2019, as
            transformers and vLLM apply it); ``> 0``, ``1`` disables.
        presence_penalty: subtracted once from the logit of every token already generated
            (OpenAI); ``[-2, 2]``.
        frequency_penalty: subtracted from a token's logit once per time it was generated
            (OpenAI); ``[-2, 2]``.
        bad_words: words never generated: each is tokenized with and without a leading
            space, and its last token is banned whenever the output ends with the others
            (vLLM's rule). Non-empty strings.
        allowed_token_ids: only these ids can be sampled; ids of the vocabulary, non-empty.
        guided_decoding: structured output (a grammar the output must follow), or ``None``.
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
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    guided_decoding: GuidedDecodingParams | None = None
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
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty is in use."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def shaped(self) -> bool:
        """Whether any logit shaping applies (the runner then keeps a shaping row)."""
        return bool(self.logit_bias or self.min_tokens or self.penalized or self.bad_words
                    or self.allowed_token_ids or self.guided_decoding is not None)

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: ``best_of``, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (``temperature == 0``)."""
        return self.temperature == 0.0


def num_candidates(beam_width: int, num_eos: int) -> int:
    """Beam search's candidates per step, ``max(2, 1 + num_eos) * beam_width`` (transformers'
    rule: enough that ``beam_width`` of them never end in an EOS id); also the top
    log-probabilities each beam's row needs."""
    return max(2, 1 + num_eos) * beam_width


@dataclass
class BeamSearchParams:
    """Parameters of :meth:`nybble.LLM.beam_search` (vLLM's class of the same name).

    Args:
        beam_width: beams kept per step (and sequences returned), ``>= 1``.
        max_tokens: tokens generated at most per beam, ``>= 1``.
        ignore_eos: EOS does not end a beam.
        temperature: must be ``0`` (beam search here is deterministic).
        length_penalty: a finished beam scores ``cumulative_logprob / generated_len **
            length_penalty``; generated_len counts the EOS token, not the prompt
            (transformers' semantics).
        early_stopping: ``True``, ``False`` or ``"never"`` (transformers' semantics, see
            :class:`SamplingParams`; not a vLLM field).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        """The equivalent :class:`SamplingParams` (every beam returned)."""
        return SamplingParams(n=self.beam_width, temperature=self.temperature,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              use_beam_search=True, beam_width=self.beam_width,
                              length_penalty=self.length_penalty,
                              early_stopping=self.early_stopping)
