"""The output side of a request: text, parameters, per-sample output state, timestamps.

The engine core never sees this object (it deals in token ids); the output processor keeps
one per request to detokenize, apply stop strings and build :class:`RequestOutput` snapshots.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nybble.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nybble.tokenizer.detokenizer import IncrementalDetokenizer
from nybble.runtime.scheduler.sequence import FinishReason
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import SamplingParams


# The scheduler's finish codes (FinishReason, a cpdef enum of the Cython core) as OpenAI's
# ``finish_reason`` strings; NONE (still running) has none.
FINISH_REASON_OPENAI: dict[FinishReason, str | None] = {
    FinishReason.NONE: None, FinishReason.STOPPED: "stop", FinishReason.LENGTH: "length",
    FinishReason.ABORTED: "abort"}


@dataclass
class Sample:
    """State of one of a request's ``n`` samples (one scheduler sequence)."""

    output: CompletionOutput
    detok: IncrementalDetokenizer


@dataclass
class Request:
    """One request as the engine tracks it.

    Attributes:
        request_id: the caller's id.
        prompt: text, or ``None`` when token ids were given.
        prompt_token_ids: the prompt's ids.
        params: sampling parameters (``max_tokens`` resolved by the request gate).
        samples: per-sample state (``params.num_sequences`` of them: ``best_of`` when set).
        metrics: timestamps (seconds, ``time.monotonic()``).
        prompt_logprobs: with ``prompt_logprobs`` asked, the entries received so far (the
            first is ``None``), else ``None``.
        num_cached_tokens: prompt tokens its first step found in the prefix cache.
        prompt_only: the gate's ``EngineCoreRequest.prompt_only`` (``max_tokens`` 0): the
            token the core sampled is dropped, the samples end with ``"length"``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    metrics: RequestMetrics
    num_finished: int = 0
    new_tokens: int = field(default=0)
    changed: set[int] = field(default_factory=set)   # samples with news since the last delta
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_sent: bool = False                # a delta carried them already
    num_cached_tokens: int = 0
    prompt_only: bool = False

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_ids: list[int],
               params: SamplingParams, arrival_time: float,
               tokenizer: Tokenizer, prompt_only: bool = False) -> Request:
        """Build the request and the output state of its ``n`` samples (``prompt_only``: see
        the class)."""
        ranked = params.num_sequences > params.n   # best_of: ranked by cumulative logprob
        samples = [Sample(output=CompletionOutput(
                              index=i, logprobs=[] if params.logprobs is not None else None,
                              cumulative_logprob=0.0 if params.logprobs is not None or ranked
                              else None),
                          detok=IncrementalDetokenizer(tokenizer, prompt_ids, params))
                   for i in range(params.num_sequences)]
        return cls(request_id, prompt, prompt_ids, params, samples,
                   RequestMetrics(arrival_time=arrival_time),
                   prompt_logprobs=None if params.prompt_logprobs is None else [None],
                   prompt_only=prompt_only)

    @property
    def finished(self) -> bool:
        """Every sample has ended."""
        return self.num_finished == len(self.samples)

    def add_prompt_logprobs(self, start: int, entries: list[dict[int, float]]) -> None:
        """Append the entries of prompt tokens ``start ..`` (chunks arrive in order)."""
        assert self.prompt_logprobs is not None and start == len(self.prompt_logprobs), \
            "prompt logprobs chunks arrive once each, in order"
        self.prompt_logprobs.extend(entries)

    def _prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is not None and \
            len(self.prompt_logprobs) == len(self.prompt_token_ids)

    def to_output(self) -> RequestOutput:
        """A cumulative :class:`RequestOutput` snapshot (copies of the per-sample state);
        a finished ``best_of`` request keeps its ``n`` best samples."""
        outs = [CompletionOutput(index=s.output.index, text=s.output.text,
                                 token_ids=list(s.output.token_ids),
                                 finish_reason=s.output.finish_reason,
                                 logprobs=None if s.output.logprobs is None
                                 else list(s.output.logprobs),
                                 stop_reason=s.output.stop_reason,
                                 cumulative_logprob=s.output.cumulative_logprob)
                for s in self.samples]
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                            self.finished, self.metrics, self.new_tokens,
                            list(self.prompt_logprobs) if self._prompt_logprobs_done()
                            else None, self.num_cached_tokens)
        if self.finished and len(outs) > self.params.n:
            out.keep_best(self.params.n)
        return out

    def take_delta(self) -> RequestOutput:
        """A DELTA :class:`RequestOutput`: for each sample in :attr:`changed`, the text, token
        ids and logprobs gained since the previous delta, and its finish reason once set.

        NOTE: the lists are handed over, not copied, and the samples' outputs start empty
        again, so a request's output state never grows with what was already sent (see
        :meth:`RequestOutput.add` to merge deltas).
        """
        outs = []
        for index in sorted(self.changed):
            o = self.samples[index].output
            outs.append(CompletionOutput(index=o.index, text=o.text, token_ids=o.token_ids,
                                         finish_reason=o.finish_reason, logprobs=o.logprobs,
                                         stop_reason=o.stop_reason,
                                         cumulative_logprob=o.cumulative_logprob))
            o.text, o.token_ids = "", []
            if o.logprobs is not None:
                o.logprobs = []
        self.changed.clear()
        prompt_logprobs = None
        if not self.prompt_logprobs_sent and self._prompt_logprobs_done():
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             self.finished, self.metrics, self.new_tokens, prompt_logprobs,
                             self.num_cached_tokens)
