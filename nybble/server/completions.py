"""``POST /v1/completions``: prompts -> the serving pipeline; completion-shaped chunks."""
from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nybble.errors import InvalidRequestError
from nybble.outputs import CompletionOutput, RequestOutput
from nybble.runtime.frontend.input_processor import DEFAULT_NAMES
from nybble.sampling_params import SamplingParams
from nybble.server.auth import require_api_key
from nybble.server.logprobs import SampleDecoder, completion_logprobs
from nybble.server.openapi import generation_responses
from nybble.server.protocol import CompletionRequest
from nybble.server.responses import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    UsageInfo,
)
from nybble.server.serving import arrival, json_response, new_id, sampling_params, serve
from nybble.server.state import ServerState, get_state, wait_ready
from nybble.server.streams import Delta, sse, usage_of

router = APIRouter(dependencies=[Depends(require_api_key), Depends(wait_ready)])


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """Each prompt of ``req.prompt``: a string, or a list of token ids (checked by the gate)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]                       # type: ignore[arg-type]
    return list(prompt)                             # type: ignore[arg-type]


def beam_params(req: CompletionRequest, params: SamplingParams) -> SamplingParams:
    """``params`` with the request's beam-search fields (the gate checks their values);
    an omitted ``temperature`` is 0 with ``use_beam_search``.

    Raises:
        InvalidRequestError: ``stream`` with ``use_beam_search`` (the beams are known only
            when the search ends).
    """
    if not req.use_beam_search:
        extra = {"length_penalty": req.length_penalty, "early_stopping": req.early_stopping}
        given = {k: v for k, v in extra.items() if v is not None}
        return dataclasses.replace(params, **given)  # NOTE: the gate refuses non-defaults
    if req.stream:
        raise InvalidRequestError("stream must be false with use_beam_search (the beams are "
                                  "known only when the search ends), got true", param="stream")
    return dataclasses.replace(
        params, use_beam_search=True,
        temperature=0.0 if req.temperature is None else req.temperature,
        length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
        early_stopping=False if req.early_stopping is None else req.early_stopping)


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(CompletionResponse, CompletionResponse))
async def create_completion(req: CompletionRequest,
                            request: Request) -> CompletionResponse | Response:
    """OpenAI completions: one choice per prompt and sample, index ``prompt * n + sample``.

    With ``stream: true`` the answer is server-sent events (``text/event-stream``): one
    ``text_completion`` JSON object per ``data:`` line, then ``data: [DONE]``.

    Raises:
        InvalidRequestError: a bad parameter or a prompt too long for ``max_model_len`` (400).
        ModelNotFoundError: ``model`` is not the served model (404).
    """
    t0 = arrival()
    state = get_state(request)
    state.check_model(req.model)
    # NOTE: echo with logprobs returns the prompt's logprobs too (OpenAI, vLLM)
    params = beam_params(req, sampling_params(req, req.max_tokens, req.logprobs,
                                              req.logprobs if req.echo else None,
                                              state.sampling_defaults))
    renderer = CompletionRenderer(state, req, new_id("cmpl", request))
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return await serve(request, state, renderer, params, DEFAULT_NAMES, t0, req.stream,
                       include_usage, state.lora_request(req.model))  # type: ignore[return-value]


class CompletionRenderer:
    """Completion chunk and response shapes (choice ``prompt_index * n + sample``; with
    ``echo`` the prompt text leads each choice)."""

    def __init__(self, state: ServerState, req: CompletionRequest, request_id: str) -> None:
        self.state, self.req, self.request_id = state, req, request_id
        self.model_name = state.response_model(req.model)
        self.logprobs = req.logprobs is not None
        self._prompts = prompt_list(req)
        self._echo: list[str] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts."""
        return self._prompts

    def echo_texts(self) -> list[str]:
        """The text each choice starts with: the prompt with ``echo``, else ``""``.

        NOTE: first called on the worker thread once the gate accepted the prompts (token
        ids are then in the vocabulary and decoded).
        """
        if self._echo is None:
            decode = self.state.tokenizer.decode
            self._echo = [("" if not self.req.echo else p if isinstance(p, str)
                           else decode(p, skip_special_tokens=True)) for p in self._prompts]
        return self._echo

    def text_offsets(self) -> list[int]:
        """Per prompt, the length of its echoed text (``text_offset`` starts there)."""
        return [len(t) for t in self.echo_texts()]

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(CompletionResponse(id=self.request_id, model=self.model_name,
                                      choices=choices, usage=usage))

    def preamble(self) -> list[str]:
        """The echoed prompts, one chunk per choice."""
        events, n = [], self.req.n
        for i, text in enumerate(self.echo_texts()):
            if text:
                events.extend(self._chunk([CompletionChoice(index=i * n + j, text=text)])
                              for j in range(n))
        return events

    def delta_chunk(self, prompt_index: int, delta: Delta) -> str:
        """One choice's new text (and logprobs)."""
        lp = None
        if self.req.logprobs is not None and delta.logprobs:
            lp = completion_logprobs(delta.decoder, delta.token_ids, delta.logprobs,
                                     self.req.logprobs)
        return self._chunk([CompletionChoice(index=prompt_index * self.req.n + delta.index,
                                             text=delta.text, logprobs=lp,
                                             finish_reason=delta.finish_reason)])  # type: ignore[arg-type]

    def usage_chunk(self, usage: UsageInfo) -> str:
        """The usage chunk (empty ``choices``)."""
        return self._chunk([], usage)

    def response(self, finals: list[RequestOutput]) -> Response:
        """The ``text_completion`` object (choices built and serialized one at a time)."""
        head = CompletionResponse(id=self.request_id, model=self.model_name, choices=[],
                                  usage=usage_of(finals))
        return json_response(head, (self._choice(i, out, o) for i, out in enumerate(finals)
                                    for o in out.outputs))

    def _prompt_logprobs(self, out: RequestOutput, k: int) -> CompletionLogProbs | None:
        """The echoed prompt's logprobs (``None`` without ``echo``): offsets index the echoed
        text, which leaves out special tokens."""
        if not self.req.echo or out.prompt_logprobs is None:
            return None
        tokenizer = self.state.tokenizer
        decoder = SampleDecoder(tokenizer, [], 0, hidden=tokenizer.special_ids)
        return completion_logprobs(decoder, out.prompt_token_ids, out.prompt_logprobs, k)

    def _choice(self, prompt_index: int, out: RequestOutput,
                o: CompletionOutput) -> CompletionChoice:
        echo, k = self.echo_texts()[prompt_index], self.req.logprobs
        lp = None
        if k is not None and o.logprobs is not None:
            lp = self._prompt_logprobs(out, k)
            decoder = SampleDecoder(self.state.tokenizer, out.prompt_token_ids, len(echo))
            lp = completion_logprobs(decoder, o.token_ids, o.logprobs, k, into=lp)
        return CompletionChoice(index=prompt_index * self.req.n + o.index, text=echo + o.text,
                                logprobs=lp, finish_reason=o.finish_reason)  # type: ignore[arg-type]
