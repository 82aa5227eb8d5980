"""Engine streams for the serving pipeline: merge, collect, abort, deltas, SSE framing.

The engine returns CUMULATIVE outputs; :class:`DeltaTracker` turns them into per-sample text
and token deltas for streaming (by the previous text / token lengths of each output index).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from nybble.outputs import CompletionOutput, RequestOutput
from nybble.runtime.async_engine import RequestStream
from nybble.server.errors import error_payload
from nybble.server.responses import UsageInfo
from nybble.server.state import ServerState

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming handler checks whether its client is still connected (seconds)."""

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
        final[i] = out
    assert all(f is not None for f in final), "a stream ended without a finished output"
    return [f for f in final if f is not None]


async def collect(request: Request, state: ServerState,
                  streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The final output of every stream, in prompt order; ``None`` if the client went away.

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
    """Usage over finished outputs: the prompt once per prompt, every sample's tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


@dataclass(slots=True)
class Delta:
    """What one sample gained since the previous snapshot."""

    output: CompletionOutput
    text: str
    token_start: int              # index in output.token_ids of the first new token
    finish_reason: str | None     # set once, in the delta where the sample ends

    def new_tokens(self, prompt_token_ids: list[int]
                   ) -> tuple[list[int], list[int], list[dict[int, float]]]:
        """``(context, ids, logprobs)`` of the new tokens: the ids before them (prompt and
        earlier output), the new ids, and their logprob entries (``[]`` if none kept)."""
        ids = self.output.token_ids
        entries = self.output.logprobs or []
        return (prompt_token_ids + ids[:self.token_start], ids[self.token_start:],
                entries[self.token_start:len(ids)])


class DeltaTracker:
    """Turns cumulative :class:`RequestOutput` snapshots into per-sample deltas."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], tuple[int, int, bool]] = {}

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        """The non-empty deltas of ``out`` (new text/tokens, or a newly set finish reason)."""
        result = []
        for o in out.outputs:
            key = (prompt_index, o.index)
            text_len, tok_len, done = self._seen.get(key, (0, 0, False))
            if done:
                continue
            finish = o.finish_reason
            if len(o.text) > text_len or len(o.token_ids) > tok_len or finish is not None:
                result.append(Delta(o, o.text[text_len:], tok_len, finish))
                self._seen[key] = (max(text_len, len(o.text)), len(o.token_ids),
                                   finish is not None)
        return result


def sse(payload: BaseModel | dict[str, object]) -> str:
    """One server-sent event ``data: <json>`` line pair."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """The OpenAI error body as an SSE event, for errors after the stream started."""
    return sse(error_payload(exc)[1])
