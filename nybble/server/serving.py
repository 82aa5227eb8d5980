"""The core shared by completions and chat: parameters, length checks, submission, streams.

The engine returns CUMULATIVE outputs; :class:`DeltaTracker` turns them into per-sample text
and token deltas for streaming (by the previous text / token lengths of each output index).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel

from nybble.errors import InvalidRequestError
from nybble.outputs import CompletionOutput, RequestOutput
from nybble.runtime.async_engine import RequestStream
from nybble.sampling_params import SamplingParams
from nybble.server.errors import error_payload
from nybble.server.protocol import UsageInfo, _SamplingFields
from nybble.server.state import ServerState

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming handler checks whether its client is still connected (seconds)."""


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None,
                    state: ServerState) -> SamplingParams:
    """Build :class:`SamplingParams` from the request's fields (OpenAI defaults for ``None``).

    Raises:
        InvalidRequestError: a value outside its range (names the parameter), or more
            logprobs than the server allows.
    """
    if logprobs is not None and logprobs > state.config.max_logprobs:
        raise InvalidRequestError(f"logprobs must be <= {state.config.max_logprobs}, "
                                  f"got {logprobs}", param="logprobs")
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    for name, value in neutral.items():
        got = getattr(req, name)
        if got is not None and got != value:
            raise InvalidRequestError(f"{name} is not supported by nybble: it must be {value} "
                                      f"or absent, got {got}", param=name)
    if req.logit_bias:
        raise InvalidRequestError("logit_bias is not supported by nybble: it must be empty or "
                                  f"absent, got {len(req.logit_bias)} entries", param="logit_bias")
    if req.suffix:
        raise InvalidRequestError(f"suffix is not supported by nybble: it must be empty or "
                                  f"absent, got {req.suffix!r}", param="suffix")
    if req.tools:
        raise InvalidRequestError(f"tools are not supported by nybble: the list must be empty "
                                  f"or absent, got {len(req.tools)} tools", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise InvalidRequestError(f"response_format must be {{'type': 'text'}} or absent (nybble "
                                  f"has no guided decoding), got {req.response_format}",
                                  param="response_format")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError(f"best_of is not supported by nybble: it must equal n "
                                  f"({req.n}) or be absent, got {req.best_of}", param="best_of")
    vocab = state.vocab_size
    if any(not 0 <= t < vocab for t in req.stop_token_ids or []):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab}), "
                                  f"got {req.stop_token_ids}", param="stop_token_ids")
    return SamplingParams(
        n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, max_tokens=max_tokens,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        logprobs=logprobs)


def check_prompt_ids(ids: Sequence[int], state: ServerState, param: str = "prompt") -> None:
    """Reject an empty prompt or token ids outside the vocabulary.

    Raises:
        InvalidRequestError: with ``param`` as the parameter.
    """
    if len(ids) == 0:
        raise InvalidRequestError(f"{param} must be non-empty, got an empty prompt", param=param)
    vocab = state.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"{param} must hold token ids in [0, {vocab}), got {bad[:5]}",
                                  param=param)


def resolve_max_tokens(num_prompt: int, max_tokens: int | None, state: ServerState,
                       param: str = "max_tokens") -> int:
    """``max_tokens`` checked against ``max_model_len`` (``None``: the rest of the context).

    Raises:
        InvalidRequestError: ``max_tokens < 1``, or prompt + ``max_tokens`` tokens exceed
            ``max_model_len`` (the message names both numbers).
    """
    limit = state.max_model_len
    if max_tokens is None:
        max_tokens = limit - num_prompt
        if max_tokens < 1:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, which leaves no room to generate within "
                f"max_model_len ({limit} tokens)", param="messages")
        return max_tokens
    if max_tokens < 1:
        raise InvalidRequestError(f"{param} must be >= 1, got {max_tokens}", param=param)
    if num_prompt + max_tokens > limit:
        raise InvalidRequestError(
            f"this model's maximum context length is {limit} tokens, but the prompt has "
            f"{num_prompt} tokens and {param} is {max_tokens} "
            f"({num_prompt + max_tokens} in total)", param=param)
    return max_tokens


async def submit(state: ServerState, request_id: str, prompts: list[list[int]],
                 params: SamplingParams, arrival_time: float) -> list[RequestStream]:
    """Add one engine request per prompt (ids ``<request_id>-<i>``); all or none.

    Raises:
        InvalidRequestError: the engine rejected one of them (the others are aborted).
    """
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            streams.append(await state.engine.add_request(f"{request_id}-{i}", ids, params,
                                                          arrival_time=arrival_time))
    except BaseException:
        abort_unfinished(state, streams)
        raise
    return streams


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
    """
    task = asyncio.ensure_future(_collect(streams))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
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


SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499
"""Status logged for a request whose client disconnected first (nginx's convention)."""


def sse_error(exc: BaseException) -> str:
    """The OpenAI error body as an SSE event, for errors after the stream started."""
    return sse(error_payload(exc)[1])


def arrival() -> float:
    """``time.monotonic()`` now: the request's arrival time (seconds)."""
    return time.monotonic()
