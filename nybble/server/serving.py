"""The serving pipeline shared by completions and chat: gate, submit, stream or collect.

A handler turns its request into prompts (text or token ids), :class:`SamplingParams` and the
API's parameter names, and hands them to :func:`serve` with a :class:`Renderer` that knows
its endpoint's chunk and response shapes. :func:`serve` passes every prompt through the
engine's request gate before anything is queued (a bad prompt queues nothing), submits them,
then either streams SSE chunks or collects the final outputs; a client that goes away, or any
error, aborts the unfinished requests so their KV blocks are freed.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from nybble.outputs import RequestOutput
from nybble.runtime.async_engine import RequestStream
from nybble.runtime.input_processor import ParamNames
from nybble.sampling_params import SamplingParams
from nybble.server.protocol import ChatMessage, _SamplingFields
from nybble.server.responses import UsageInfo
from nybble.server.state import ServerState
from nybble.server.streams import (
    CLIENT_CLOSED,
    SSE_DONE,
    Delta,
    DeltaTracker,
    abort_unfinished,
    collect,
    merge,
    sse_error,
    usage_of,
)


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def arrival() -> float:
    """``time.monotonic()`` now: the request's arrival time (seconds)."""
    return time.monotonic()


def sampling_params(req: _SamplingFields, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The request's fields as :class:`SamplingParams` (OpenAI defaults for ``None``).

    No value is checked here: the engine's request gate checks every range.
    """
    return SamplingParams(
        n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, max_tokens=max_tokens,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        logprobs=logprobs)


def render_chat(state: ServerState, messages: list[ChatMessage],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    The template already emits BOS, so the rendered text is tokenized without adding special
    tokens again.

    Raises:
        InvalidRequestError: the tokenizer has no chat template, or the template refused the
            conversation.
    """
    text = state.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text()} for m in messages],
        add_generation_prompt=add_generation_prompt)
    return state.tokenizer.encode(text, add_special_tokens=False)


class Renderer(Protocol):
    """What one endpoint renders; everything else is the shared pipeline.

    Attributes:
        request_id: the response id (engine requests are ``<request_id>-<prompt index>``).
    """

    request_id: str

    def preamble(self) -> list[str]:
        """SSE events sent before the first token (chat: the role deltas; completions: the
        echoed prompts)."""

    def delta_chunk(self, prompt_index: int, out: RequestOutput, delta: Delta) -> str:
        """The SSE event of one sample's delta."""

    def usage_chunk(self, usage: UsageInfo) -> str:
        """The final SSE event with usage and no choices (``stream_options.include_usage``)."""

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        """The non-streaming response from the final output of every prompt."""


async def serve(request: Request, state: ServerState, renderer: Renderer,
                prompts: Sequence[str | list[int]], params: SamplingParams, names: ParamNames,
                arrival_time: float, stream: bool,
                include_usage: bool) -> BaseModel | Response:
    """Gate, submit and answer one API request (``n`` samples of every prompt).

    Raises:
        InvalidRequestError: the request gate refused a prompt or a parameter (nothing was
            queued).
        EngineDeadError, EngineShutdownError: the engine cannot take requests (503).
    """
    gate = state.input_processor
    requests = [gate.process(f"{renderer.request_id}-{i}", prompt, params, arrival_time, names)
                for i, prompt in enumerate(prompts)]
    texts = [p if isinstance(p, str) else None for p in prompts]
    streams = state.engine.add_requests(requests, texts)
    if stream:
        return StreamingResponse(_events(state, renderer, streams, include_usage),
                                 media_type="text/event-stream")
    finals = await collect(request, state, streams)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return renderer.response(finals)


async def _events(state: ServerState, renderer: Renderer, streams: list[RequestStream],
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE: the preamble, one event per sample delta, optional usage, then ``[DONE]``; an
    error after the headers went out is reported in-band."""
    tracker = DeltaTracker()
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        for event in renderer.preamble():
            yield event
        async for i, out in merge(streams):
            for d in tracker.deltas(i, out):
                yield renderer.delta_chunk(i, out, d)
            if out.finished:
                finals[i] = out
        if include_usage:
            yield renderer.usage_chunk(usage_of([f for f in finals if f is not None]))
        yield SSE_DONE
    except Exception as exc:  # noqa: BLE001 -- headers are sent; report it in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_unfinished(state, streams)
