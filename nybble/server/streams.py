"""Engine streams for the serving pipeline: merge, collect, abort, per-sample deltas, SSE.

The engine sends DELTA outputs (per sample, only what is new since the previous one).
:func:`collect` merges them into each request's whole result; :class:`DeltaTracker` turns
them into the deltas a stream sends: a sample's tokens whose text is still held back (a
possible stop string, an incomplete UTF-8 character) wait for the next delta that has text,
so a stream never carries an empty delta before the sample's last one.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from nybble.outputs import RequestOutput
from nybble.runtime.frontend.async_engine import RequestStream
from nybble.server.errors import error_payload
from nybble.server.logprobs import CONTEXT_TOKENS, SampleDecoder
from nybble.server.responses import PromptTokensDetails, UsageInfo
from nybble.server.state import ServerState

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming handler checks whether its client is still connected (seconds;
a check is one non-blocking look at the connection; the bundled model decodes a few hundred
tokens in 0.1 s)."""

SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499
"""Status logged for a request whose client disconnected first (nginx's convention)."""


def abort_unfinished(state: ServerState, streams: list[RequestStream]) -> None:
    """Abort the streams that have not finished (the client went away or an error occurred)."""
    for s in streams:
        if not s.finished:
            state.engine.abort(s.request_id)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as ``(prompt_index, output)`` in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 -- re-raised by the consumer below
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    final: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        whole = final[i]
        if whole is None:
            final[i] = out
        else:
            whole.add(out)
    assert all(f is not None and f.finished for f in final), \
        "a stream ended without a finished output"
    return [f for f in final if f is not None]


async def collect(request: Request, state: ServerState,
                  streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The whole result of every stream (its deltas merged), in prompt order; ``None`` if the
    client went away.

    Every ``DISCONNECT_POLL_S`` seconds it checks the connection; on a disconnect, or any
    error, the unfinished requests are aborted so their KV blocks are freed.

    Raises:
        EngineShutdownError: the server began shutting down while the requests ran.
        EngineDeadError, EngineRequestError: the engine failed them.
    """
    task = asyncio.ensure_future(_collect(streams))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                finals = task.result()
                # NOTE: ended from outside (server shutdown): no partial response
                errors = [s.error for s in streams if s.error is not None]
                if errors:
                    raise errors[0]
                return finals
            if await request.is_disconnected():
                return None
    finally:
        task.cancel()
        abort_unfinished(state, streams)


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Usage over whole results: the prompt once per prompt, every sample's tokens, and the
    prompt tokens the prefix cache held (``prompt_tokens_details.cached_tokens``)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion, prompt_tokens_details=cached)


@dataclass(slots=True)
class Delta:
    """What one sample shows next in a stream.

    Attributes:
        index: the sample's index in ``[0, n)``.
        text: its new text.
        token_ids: the tokens since its previous delta (tokens that added no text yet
            included).
        logprobs: their logprob entries (``[]`` when not asked for).
        finish_reason: set once, in the sample's last delta.
        decoder: the sample's token decoder for logprobs (continues across its deltas).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None
    decoder: SampleDecoder


@dataclass(slots=True)
class _Sample:
    decoder: SampleDecoder
    token_ids: list[int] = field(default_factory=list)     # not shown yet
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_tokens: int = 0


class DeltaTracker:
    """Per-sample stream deltas from the engine's delta outputs, and the stream's usage.

    Args:
        tokenizer: the model's tokenizer (logprob token strings).
        text_offsets: per prompt, the characters each of its choices starts with (the
            echoed prompt with ``echo``, else 0).
    """

    def __init__(self, tokenizer: Any, text_offsets: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.text_offsets = text_offsets
        self._samples: dict[tuple[int, int], _Sample] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._cached_tokens: dict[int, int] = {}

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        """The deltas to send for ``out``: samples with new text, or that finished."""
        self._prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        self._cached_tokens[prompt_index] = max(self._cached_tokens.get(prompt_index, 0),
                                                out.num_cached_tokens)
        result = []
        for o in out.outputs:
            key = (prompt_index, o.index)
            sample = self._samples.get(key)
            if sample is None:
                offset = self.text_offsets[prompt_index] if self.text_offsets else 0
                sample = self._samples[key] = _Sample(SampleDecoder(
                    self.tokenizer, out.prompt_token_ids[-CONTEXT_TOKENS:], offset))
            sample.token_ids.extend(o.token_ids)
            sample.logprobs.extend(o.logprobs or ())
            sample.num_tokens += len(o.token_ids)
            if not o.text and o.finish_reason is None:
                continue  # NOTE: text held back: its tokens go with the next delta
            result.append(Delta(o.index, o.text, sample.token_ids, sample.logprobs,
                                o.finish_reason, sample.decoder))
            sample.token_ids, sample.logprobs = [], []
        return result

    def usage(self) -> UsageInfo:
        """Usage of what was streamed: each prompt once, every sample's tokens, the prompt
        tokens the prefix cache held."""
        prompt = sum(self._prompt_tokens.values())
        completion = sum(s.num_tokens for s in self._samples.values())
        cached = PromptTokensDetails(cached_tokens=sum(self._cached_tokens.values()))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion, prompt_tokens_details=cached)


def sse(payload: BaseModel | dict[str, object]) -> str:
    """One server-sent event ``data: <json>`` line pair."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """The OpenAI error body as an SSE event, for errors after the stream started."""
    return sse(error_payload(exc)[1])
