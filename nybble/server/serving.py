"""The serving pipeline shared by completions and chat: gate, submit, stream or collect.

A handler turns its request into prompts (text or token ids), :class:`SamplingParams` and the
API's parameter names, and hands them to :func:`serve` with a :class:`Renderer` that knows
its endpoint's chunk and response shapes. :func:`serve` passes every prompt through the
engine's request gate before anything is queued (a bad prompt queues nothing), submits them,
then either streams SSE chunks or collects the final outputs; a client that goes away, or any
error, aborts the unfinished requests so their KV blocks are freed. Everything that can take
long for a large request (chat template, tokenization, the gate, logprob rendering, the whole
response) runs on the server's worker threads (:func:`run_blocking`).
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from nybble.errors import InvalidRequestError
from nybble.outputs import RequestOutput
from nybble.runtime.frontend.async_engine import RequestStream
from nybble.runtime.frontend.input_processor import ParamNames
from nybble.tokenizer.chat_messages import template_messages
from nybble.runtime.messages import EngineCoreRequest
from nybble.sampling_params import SamplingParams
from nybble.lora_request import LoRARequest
from nybble.server.protocol import ChatMessage, ChatOptions, _SamplingFields
from nybble.server.responses import UsageInfo
from nybble.server.sampling_fields import guided_decoding, logit_bias
from nybble.server.middleware import client_request_id
from nybble.server.state import ServerState, run_blocking
from nybble.server.tool_choice import check_tools
from nybble.server.streams import (
    CLIENT_CLOSED,
    SSE_DONE,
    Delta,
    DeltaTracker,
    abort_unfinished,
    collect,
    merge,
    sse_error,
)


def new_id(prefix: str, request: Request | None = None) -> str:
    """The response id: ``<prefix>-<X-Request-Id>`` when ``request`` carries a usable one
    (:func:`nybble.server.middleware.client_request_id`; then the engine's request ids and
    its log lines carry it too), else ``<prefix>-<32 hex>``.

    NOTE: a client id still in flight makes the second request a 400 (ids must be unique
    while they run)."""
    rid = client_request_id(request.headers) if request is not None else None
    return f"{prefix}-{rid if rid is not None else uuid.uuid4().hex}"


def arrival() -> float:
    """``time.monotonic()`` now: the request's arrival time (seconds)."""
    return time.monotonic()


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The request's fields as :class:`SamplingParams`: for ``None``, ``defaults`` (the
    model's generation config, ``--generation-config``), else OpenAI's defaults.

    No value is checked here: the engine's request gate checks every range.

    Raises:
        InvalidRequestError: a ``logit_bias`` key that is not a token id, or more than one
            structured-output constraint.
    """
    d = defaults or {}
    return SamplingParams(
        n=req.n, temperature=_or(req.temperature, d.get("temperature", 1.0)),
        top_p=_or(req.top_p, d.get("top_p", 1.0)), top_k=_or(req.top_k, d.get("top_k", -1)),
        min_p=_or(req.min_p, d.get("min_p", 0.0)), seed=req.seed,
        max_tokens=_or(max_tokens, d.get("max_tokens")),
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, best_of=req.best_of,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=logit_bias(req), min_tokens=req.min_tokens,
        repetition_penalty=_or(req.repetition_penalty, d.get("repetition_penalty", 1.0)),
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0), bad_words=req.bad_words,
        allowed_token_ids=req.allowed_token_ids, guided_decoding=guided_decoding(req))


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def check_prompt_chars(state: ServerState, text: str, param: str) -> None:
    """The cheap length check before tokenizing: refuse text too long to fit however it
    tokenizes (:attr:`ServerState.max_prompt_chars`).

    Raises:
        InvalidRequestError: naming ``param``, the length and the limit.
    """
    limit = state.max_prompt_chars
    if len(text) > limit:
        raise InvalidRequestError(
            f"{param} must be at most {limit} characters to fit max_model_len "
            f"({state.max_model_len} tokens of at most {state.max_token_chars} characters "
            f"each), got {len(text)} characters", param=param)


def render_chat(state: ServerState, req: ChatOptions,
                messages: list[ChatMessage]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (the model's, or
    ``req.chat_template``) and ``req``'s options (``add_generation_prompt``,
    ``continue_final_message``, ``chat_template_kwargs``, ``tools``: the messages' tool calls
    and the tools as transformers gives them to templates,
    :func:`nybble.tokenizer.chat_messages.template_messages`); blocking: call it on a worker
    thread, :func:`run_blocking`.

    The template already emits BOS, so the rendered text is tokenized without adding special
    tokens again; only the template's own markers are special tokens
    (:func:`nybble.tokenizer.chat_encode.encode_conversation`). The messages, then the rendered text, pass :func:`check_prompt_chars` first.

    Raises:
        InvalidRequestError: the conversation is too long, there is no chat template, or the
            template refused the conversation.
    """
    conversation = template_messages([m.template_dict() for m in messages])
    check_prompt_chars(state, "".join(m["content"] for m in conversation), "messages")
    options = dict(add_generation_prompt=req.add_generation_prompt,
                   continue_final_message=req.continue_final_message,
                   chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs,
                   tools=check_tools(req.tools))
    text = state.tokenizer.apply_chat_template(conversation, **options)
    check_prompt_chars(state, text, "messages")
    # NOTE: text in a message that spells a control token stays text (prompt injection)
    return state.tokenizer.encode_conversation(conversation, text, **options)


class Renderer(Protocol):
    """What one endpoint renders; everything else is the shared pipeline.

    Attributes:
        request_id: the response id (engine requests are ``<request_id>-<prompt index>``).
        logprobs: logprobs were asked for (chunks are then rendered on a worker thread).
    """

    request_id: str
    logprobs: bool

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (blocking work, such as a chat template, is allowed: it runs
        on a worker thread)."""

    def text_offsets(self) -> list[int] | None:
        """Per prompt, the characters each choice starts with (echo), or ``None``; called
        on the worker thread after the gate accepted the prompts."""

    def preamble(self) -> list[str]:
        """SSE events sent before the first token (chat: the role deltas; completions: the
        echoed prompts)."""

    def delta_chunk(self, prompt_index: int, delta: Delta) -> str:
        """The SSE event of one sample's delta."""

    def usage_chunk(self, usage: UsageInfo) -> str:
        """The final SSE event with usage and no choices (``stream_options.include_usage``)."""

    def response(self, finals: list[RequestOutput]) -> Response:
        """The non-streaming response from the whole result of every prompt (blocking: runs
        on a worker thread; :func:`json_response`)."""


def _gate(state: ServerState, renderer: Renderer, params: SamplingParams, names: ParamNames,
          arrival_time: float, lora_request: LoRARequest | None = None
          ) -> tuple[list[EngineCoreRequest], list[str | None]]:
    """Prompts, their checks and the request gate (blocking: runs on a worker thread)."""
    prompts = renderer.prompts()
    cap = state.config.max_seqs_per_request
    n = params.num_sequences if isinstance(params.num_sequences, int) else 1
    if len(prompts) * n > cap:
        param = names.prompt if len(prompts) > 1 else "n"
        raise InvalidRequestError(
            f"prompts x n must be <= {cap} sequences per request (--max-seqs-per-request), "
            f"got {len(prompts)} prompts x n {n} = {len(prompts) * n}", param=param)
    for p in prompts:
        if isinstance(p, str):
            check_prompt_chars(state, p, names.prompt)
    gate = state.input_processor
    requests = [gate.process(f"{renderer.request_id}-{i}", prompt, params, arrival_time, names,
                             lora_request) for i, prompt in enumerate(prompts)]
    renderer.text_offsets()
    return requests, [p if isinstance(p, str) else None for p in prompts]


async def serve(request: Request, state: ServerState, renderer: Renderer,
                params: SamplingParams, names: ParamNames, arrival_time: float, stream: bool,
                include_usage: bool, lora_request: LoRARequest | None = None
                ) -> BaseModel | Response:
    """Gate, submit and answer one API request (``n`` samples of every prompt), under
    ``lora_request``'s adapter when given.

    Tokenization, chat templates and logprob rendering run on the server's worker threads,
    so a large request never holds up the event loop (``/health`` and the other requests).

    Raises:
        InvalidRequestError: too many sequences, a prompt too long, or the request gate
            refused a prompt or a parameter (nothing was queued).
        EngineDeadError, EngineShutdownError: the engine cannot take requests (503).
        EngineOverloadedError: too many requests are waiting (503).
    """
    requests, texts = await run_blocking(state, _gate, state, renderer, params, names,
                                         arrival_time, lora_request)
    streams = state.engine.add_requests(requests, texts)
    if stream:
        return EngineStreamingResponse(state, streams,
                                       _events(state, renderer, streams, include_usage))
    finals = await collect(request, state, streams)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    if params.num_sequences > params.n:    # best_of: keep the n best samples
        for final in finals:
            final.keep_best(params.n)
    return await run_blocking(state, renderer.response, finals)


def json_response(model: BaseModel, choices: Iterable[BaseModel] = ()) -> Response:
    """``model`` as a JSON response, serialized here (call it on a worker thread) instead of
    by FastAPI on the event loop; ``choices`` (if any) go into its empty ``choices`` list.

    NOTE: a large answer (``n`` choices with logprobs) is millions of small objects if built
    whole, and the cyclic garbage collector then walks them all, holding the GIL (and so the
    event loop) for up to seconds. Each choice is therefore serialized as soon as
    ``choices`` yields it and dropped; only strings stay alive (the collector ignores them).
    The quoted key cannot occur inside a JSON string (its quotes would be escaped).
    """
    body = model.model_dump_json()
    parts = [c.model_dump_json() for c in choices]
    if parts:
        body = body.replace('"choices":[]', f'"choices":[{",".join(parts)}]', 1)
    data = body.encode()
    if len(data) <= SEND_CHUNK_BYTES:
        return Response(data, media_type="application/json")
    return StreamingResponse(_pieces(memoryview(data)), media_type="application/json",
                             headers={"Content-Length": str(len(data))})


SEND_CHUNK_BYTES = 1 << 20
"""A larger JSON answer is sent in pieces of this size (one huge socket write holds the event
loop while the kernel copies it)."""


async def _pieces(data: memoryview) -> AsyncIterator[memoryview]:
    for start in range(0, len(data), SEND_CHUNK_BYTES):
        yield data[start:start + SEND_CHUNK_BYTES]


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its unfinished engine requests however it ends.

    NOTE: not left to the body generator's own ``finally``, which runs only if the generator
    had started when the answer was cancelled (the client gone); this ``finally`` always
    runs.
    """

    def __init__(self, state: ServerState, streams: list[RequestStream],
                 content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._state, self._streams, self._content = state, streams, content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            abort_unfinished(self._state, self._streams)
            await self._content.aclose()  # type: ignore[attr-defined]


def _render(renderer: Renderer, prompt_index: int, deltas: list[Delta]) -> str:
    return "".join(renderer.delta_chunk(prompt_index, d) for d in deltas)


async def _events(state: ServerState, renderer: Renderer, streams: list[RequestStream],
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE: the preamble, the events of each output's deltas, optional usage, then
    ``[DONE]``; an error after the headers went out is reported in-band."""
    tracker = DeltaTracker(state.tokenizer, renderer.text_offsets())
    try:
        for event in renderer.preamble():
            yield event
        async for i, out in merge(streams):
            deltas = tracker.deltas(i, out)
            if not deltas:
                continue
            if renderer.logprobs:
                events = await run_blocking(state, _render, renderer, i, deltas)
            else:
                events = _render(renderer, i, deltas)
            if events:   # NOTE: empty while a parser holds text back (possible markup)
                yield events
        if include_usage:
            yield renderer.usage_chunk(tracker.usage())
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 -- headers are sent; report it in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_unfinished(state, streams)
