"""Outputs returned by :class:`nybble.LLM` and :class:`nybble.LLMEngine` (shaped like vLLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: detokenized text generated so far (stop strings removed).
        token_ids: generated token ids (a stop token id is included).
        finish_reason: ``"stop"`` (EOS, stop token or stop string), ``"length"``
            (``max_tokens`` or ``max_model_len``), ``"abort"``, or ``None`` while running.
        logprobs: per generated token, a dict ``{token_id: logprob}`` holding the sampled
            token and the top-``logprobs`` tokens; ``None`` when not requested.
        stop_reason: the stop string or the ``stop_token_ids`` entry that ended the sample;
            ``None`` otherwise, also when the model's EOS token ended it (OpenAI/vLLM).
        cumulative_logprob: sum of the logprobs of ``token_ids`` so far (the whole sample's,
            also in a delta output), when they were computed (``logprobs`` or ``best_of``
            asked, or beam search), else ``None``.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds (``time.monotonic()``).

    ``first_token_time - arrival_time`` is TTFT; ``first_scheduled_time - arrival_time`` is
    the queue time.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end, from ``LLM.generate``).

    Attributes:
        request_id: the caller's id.
        prompt: prompt text, or ``None`` when token ids were given.
        prompt_token_ids: the prompt's token ids (BOS included when the tokenizer adds it).
        outputs: one :class:`CompletionOutput` per sample.
        finished: all samples have ended.
        metrics: the request's timestamps.
        num_new_tokens: tokens generated in the step that produced this output (all samples).
        prompt_logprobs: with ``prompt_logprobs`` asked, per prompt token ``None`` (the first)
            or ``{token_id: logprob}`` holding the prompt token and the top-``k`` tokens;
            complete in the first output that has a generated token (a delta output carries
            it once), else ``None``.
        num_cached_tokens: prompt tokens found in the prefix cache when the request was
            first scheduled (vLLM's ``num_cached_tokens``; 0 without prefix caching).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_new_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0

    def add(self, later: RequestOutput) -> None:
        """Append a later DELTA output of the same request (vLLM's ``RequestOutput.add``).

        A delta output (the server's engine sends them) holds, per sample that changed, only
        what is new since the previous one: text, token ids and logprobs to append, and the
        finish reason once set. Merging two deltas gives the delta of both steps; merging
        every delta of a request into the first gives the whole result. ``later``'s lists
        are taken over, not copied.
        """
        mine = {o.index: o for o in self.outputs}
        for o in later.outputs:
            into = mine.get(o.index)
            if into is None:
                self.outputs.append(o)
                mine[o.index] = o
                continue
            into.text += o.text
            into.token_ids.extend(o.token_ids)
            if o.logprobs is not None:
                if into.logprobs is None:
                    into.logprobs = o.logprobs
                else:
                    into.logprobs.extend(o.logprobs)
            into.finish_reason = o.finish_reason or into.finish_reason
            into.stop_reason = o.stop_reason if o.stop_reason is not None else into.stop_reason
            if o.cumulative_logprob is not None:
                into.cumulative_logprob = o.cumulative_logprob
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.outputs.sort(key=lambda o: o.index)
        self.finished = later.finished
        self.metrics = later.metrics or self.metrics
        self.num_new_tokens += later.num_new_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)

    def keep_best(self, n: int) -> None:
        """Keep the ``n`` samples with the highest ``cumulative_logprob`` (``best_of``, as
        OpenAI and vLLM define it), best first, renumbered ``0 .. n-1``; ties keep the lower
        index first. Call it on a whole (finished) result."""
        ranked = sorted(self.outputs, key=lambda o: (-(o.cumulative_logprob or 0.0), o.index))
        self.outputs = ranked[:n]
        for i, o in enumerate(self.outputs):
            o.index = i

@dataclass
class BeamSearchSequence:
    """One beam of :meth:`nybble.LLM.beam_search` (vLLM's class of the same name).

    Attributes:
        tokens: prompt token ids followed by the generated ones (an EOS that ended the
            beam included).
        cum_logprob: sum of the natural-log probabilities of the generated tokens.
        score: ``cum_logprob / len(generated) ** length_penalty``, what the beams are
            ranked by (transformers' score; not a vLLM field).
        text: the decoded ``tokens`` (prompt included, special tokens skipped).
        finish_reason: ``"stop"`` (EOS or a stop token id) or ``"length"``.
        stop_reason: the ``stop_token_ids`` entry that ended it, else ``None``.
    """

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class BeamSearchOutput:
    """The result of one prompt of :meth:`nybble.LLM.beam_search`: ``sequences`` best score
    first (vLLM's class of the same name)."""

    sequences: list[BeamSearchSequence]
