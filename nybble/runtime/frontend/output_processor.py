"""OutputProcessor: the engine core's token ids -> text, stop strings and RequestOutputs.

It keeps one :class:`Request` per request (per-sample detokenizer and output state) and turns
each step's :class:`EngineCoreOutputs` into :class:`RequestOutput` objects: cumulative
snapshots (the offline engine's, vLLM's ``CUMULATIVE``), or deltas holding only what each
sample gained in the step (the server's, vLLM's ``DELTA``: nothing already sent is copied
again, so the work and memory per step do not grow with the output's length). A
sample whose text reaches a stop string is reported back, so the caller finishes it in the
engine core (vLLM V1's output processor does the same with its aborts).

NOTE: with the core in another process, a step's outputs can still carry rows of a request
the output side already ended (aborted, or a sample cut by a stop string while the core ran
its next step): such rows are ignored.
"""
from __future__ import annotations

import time

from nybble.errors import InvalidRequestError
from nybble.outputs import RequestOutput
from nybble.runtime.messages import EngineCoreOutputs, EngineCoreRequest, PromptLogprobs
from nybble.runtime.frontend.request import FINISH_REASON_OPENAI, FinishReason, Request
from nybble.tokenizer.tokenizer import Tokenizer


class OutputProcessor:
    """The per-request output state of the engine.

    Args:
        tokenizer: the model's tokenizer (detokenization).
        delta: produce delta outputs (:meth:`Request.take_delta`) instead of cumulative
            snapshots.
    """

    def __init__(self, tokenizer: Tokenizer, delta: bool = False) -> None:
        self.tokenizer = tokenizer
        self.delta = delta
        self.requests: dict[str, Request] = {}

    def check_new(self, request_id: str) -> None:
        """Raises :class:`InvalidRequestError` if ``request_id`` is already in flight."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id must be unique, got {request_id!r} twice")

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        """Start tracking a request the engine core accepted (``prompt``: its text, if any)."""
        self.requests[request.request_id] = Request.create(
            request.request_id, prompt, request.prompt_token_ids, request.params,
            request.arrival_time, self.tokenizer, prompt_only=request.prompt_only)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request; its unfinished samples end with ``"abort"``.

        Returns:
            Its final output (``finished``; in delta mode the samples it ended), or ``None``
            if it was not in flight.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for sample in request.samples:
            if sample.output.finish_reason is None:
                sample.output.finish_reason = FINISH_REASON_OPENAI[FinishReason.ABORTED]
                request.changed.add(sample.output.index)
        request.num_finished = len(request.samples)
        request.metrics.finished_time = time.monotonic()
        request.new_tokens = 0
        return self._output(request)

    def _output(self, request: Request) -> RequestOutput:
        return request.take_delta() if self.delta else request.to_output()

    def has_unfinished_requests(self) -> bool:
        """Whether any request still has a running sample."""
        return bool(self.requests)

    def process_outputs(self, core: EngineCoreOutputs
                        ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one step's tokens.

        Returns:
            ``(outputs, stopped)``: a :class:`RequestOutput` (cumulative, or a delta) per
            request that got tokens, and the ``(request_id, sample_index)`` samples a stop string ended in
            this step, which the engine core must finish (reason ``STOPPED``).
        """
        now = time.monotonic()
        cached = core.num_cached_tokens or [0] * len(core.first_scheduled)
        for rid, hit in zip(core.first_scheduled, cached, strict=True):
            if rid in self.requests:
                self.requests[rid].metrics.first_scheduled_time = core.scheduled_time
                self.requests[rid].num_cached_tokens = hit
        changed: dict[str, Request] = {}
        stopped: list[tuple[str, int]] = []
        for rid, values in (core.cumulative_logprobs or {}).items():
            if rid in self.requests:  # beam search: set before its rows end the request
                for sample, value in zip(self.requests[rid].samples, values):
                    sample.output.cumulative_logprob = value
        for chunk in core.prompt_logprobs or ():
            request = self.requests.get(chunk.request_id)
            if request is not None:
                request.add_prompt_logprobs(chunk.start, _prompt_entries(
                    chunk, request.prompt_token_ids))
        for row, (rid, index, token, code) in enumerate(zip(
                core.request_ids, core.sample_indices, core.token_ids, core.finish_reasons)):
            request = self.requests.get(rid)
            if request is None:
                continue  # NOTE: ended on this side already (see the module's note)
            sample = request.samples[index]
            out = sample.output
            if out.finish_reason is not None:
                continue
            reason = FinishReason(code)
            if request.prompt_only:
                # NOTE: scoring only: the core ran one step to compute the prompt and its
                # token is dropped (vLLM's echo with max_tokens 0 does the same)
                reason = FinishReason.LENGTH
            else:
                reason = _take_token(request, index, core, row, token, reason)
                if reason == FinishReason.STOPPED and code == FinishReason.NONE:
                    stopped.append((rid, index))   # a stop string: the core must stop it
            out.text += sample.detok.take_delta(finished=reason != FinishReason.NONE)
            m = request.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            request.new_tokens += not request.prompt_only
            request.changed.add(index)
            if reason != FinishReason.NONE:
                out.finish_reason = FINISH_REASON_OPENAI[reason]
                request.num_finished += 1
            changed[rid] = request
        outputs = []
        for request in changed.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(self._output(request))
            request.new_tokens = 0
        return outputs, stopped


def _take_token(request: Request, index: int, core: EngineCoreOutputs, row: int, token: int,
                reason: FinishReason) -> FinishReason:
    """Append one sampled token to sample ``index`` (ids, logprobs, text); returns its finish
    reason, ``STOPPED`` when its text reached a stop string."""
    sample = request.samples[index]
    out = sample.output
    out.token_ids.append(token)
    if out.cumulative_logprob is not None and core.logprobs is not None:
        out.cumulative_logprob += core.logprobs[row]
    if out.logprobs is not None:
        out.logprobs.append(_row_logprobs(core, row, token, request.params.logprobs or 0))
    if reason == FinishReason.STOPPED:
        # NOTE: stop_reason is the stop token id the *user* asked for (OpenAI/vLLM
        # semantics); a model EOS id ends the sample too, but its stop_reason is None.
        user_stops = request.params.stop_token_ids or ()
        out.stop_reason = token if token in user_stops else None
        return reason
    # NOTE: a stop token is kept in token_ids but never detokenized
    sample.detok.add_token(token)
    if sample.detok.stop_reason is not None:
        # NOTE: a stop string that completes on the last allowed token still ends the
        # sample as "stop": the text was cut by it
        reason, out.stop_reason = FinishReason.STOPPED, sample.detok.stop_reason
    return reason


def _entry(token: int, logprob: float, top_ids: list[int], top_logprobs: list[float],
           k: int) -> dict[int, float]:
    """``{token_id: logprob}`` of one position: the token itself, then the top ``k``."""
    entry = {token: float(logprob)}
    for tid, lp in zip(top_ids[:k], top_logprobs[:k]):
        entry.setdefault(tid, lp)
    return entry


def _row_logprobs(core: EngineCoreOutputs, row: int, token: int, k: int) -> dict[int, float]:
    """The entry of one sampled row: the sampled token, then its top ``k``."""
    assert core.logprobs is not None
    if k > 0 and core.top_token_ids is not None and core.top_logprobs is not None:
        return _entry(token, core.logprobs[row], core.top_token_ids[row],
                      core.top_logprobs[row], k)
    return {token: float(core.logprobs[row])}


def _prompt_entries(chunk: PromptLogprobs, prompt_ids: list[int]) -> list[dict[int, float]]:
    """The entries of one chunk of prompt logprobs (prompt token, then the top ``k``)."""
    return [_entry(prompt_ids[chunk.start + i], lp, ids, lps, len(ids))
            for i, (lp, ids, lps) in enumerate(zip(chunk.logprobs, chunk.top_token_ids,
                                                   chunk.top_logprobs))]
