"""``POST /v1/completions``: validate -> SamplingParams -> engine streams -> JSON or SSE."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from nybble.errors import InvalidRequestError
from nybble.outputs import RequestOutput
from nybble.runtime.async_engine import RequestStream
from nybble.server.auth import require_api_key
from nybble.server.logprobs import TokenDecoder, completion_logprobs
from nybble.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from nybble.server.serving import (
    CLIENT_CLOSED,
    SSE_DONE,
    DeltaTracker,
    abort_unfinished,
    arrival,
    check_prompt_ids,
    collect,
    merge,
    new_id,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_error,
    submit,
    usage_of,
)
from nybble.server.state import ServerState, get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


def parse_prompts(req: CompletionRequest, state: ServerState) -> list[tuple[str, list[int]]]:
    """Each prompt as ``(text, token_ids)``; text prompts get the tokenizer's BOS.

    Raises:
        InvalidRequestError: an empty prompt, an empty list, or ids outside the vocabulary.
    """
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif not prompt:
        raise InvalidRequestError("prompt must be non-empty, got []", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]                      # type: ignore[arg-type]
    else:
        items = list(prompt)                        # type: ignore[arg-type]
    result = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError("prompt must be non-empty, got ''", param="prompt")
            ids = list(state.tokenizer(item)["input_ids"])
            result.append((item, ids))
        else:
            check_prompt_ids(item, state)
            result.append((state.tokenizer.decode(item, skip_special_tokens=True), item))
    return result


@router.post("/v1/completions", response_model=None)
async def create_completion(req: CompletionRequest,
                            request: Request) -> CompletionResponse | Response:
    """OpenAI completions: one choice per prompt and sample, index ``prompt * n + sample``.

    Raises:
        InvalidRequestError: a bad parameter or a prompt too long for ``max_model_len`` (400).
        ModelNotFoundError: ``model`` is not the served model (404).
    """
    t0 = arrival()
    state = get_state(request)
    state.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise InvalidRequestError("echo with logprobs is not supported (nybble does not "
                                  "compute prompt logprobs)", param="echo")
    prompts = parse_prompts(req, state)
    max_tokens = min(resolve_max_tokens(len(ids), req.max_tokens, state) for _, ids in prompts)
    params = sampling_params(req, max_tokens, req.logprobs, state)
    request_id = new_id("cmpl")
    streams = await submit(state, request_id, [ids for _, ids in prompts], params, t0)
    texts = [text if req.echo else "" for text, _ in prompts]
    if req.stream:
        return StreamingResponse(_stream(state, req, request_id, streams, texts),
                                 media_type="text/event-stream")
    finals = await collect(request, state, streams)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return _response(state, req, request_id, finals, texts)


def _response(state: ServerState, req: CompletionRequest, request_id: str,
              finals: list[RequestOutput], echo_texts: list[str]) -> CompletionResponse:
    decoder = TokenDecoder(state.tokenizer)
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            lp = None
            if req.logprobs is not None and o.logprobs is not None:
                lp = completion_logprobs(decoder, out.prompt_token_ids, o.token_ids,
                                         o.logprobs, req.logprobs, len(echo_texts[i]))
            choices.append(CompletionChoice(index=i * req.n + o.index,
                                            text=echo_texts[i] + o.text, logprobs=lp,
                                            finish_reason=o.finish_reason))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                              usage=usage_of(finals))


async def _stream(state: ServerState, req: CompletionRequest, request_id: str,
                  streams: list[RequestStream], echo_texts: list[str]) -> AsyncIterator[str]:
    """SSE chunks: echoed prompts, one chunk per sample delta, optional usage, ``[DONE]``."""
    def chunk(choices: list[CompletionChoice], usage: object = None) -> str:
        return sse(CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                      usage=usage))  # type: ignore[arg-type]

    decoder = TokenDecoder(state.tokenizer)
    tracker = DeltaTracker()
    offsets: dict[int, int] = {}          # choice index -> characters sent (text_offset)
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        for i, text in enumerate(echo_texts):
            for j in range(req.n):
                offsets[i * req.n + j] = len(text)
                if text:
                    yield chunk([CompletionChoice(index=i * req.n + j, text=text)])
        async for i, out in merge(streams):
            for d in tracker.deltas(i, out):
                index = i * req.n + d.output.index
                lp = None
                if req.logprobs is not None and d.output.logprobs is not None:
                    ids = d.output.token_ids
                    lp = completion_logprobs(
                        decoder, out.prompt_token_ids + ids[:d.token_start],
                        ids[d.token_start:], d.output.logprobs[d.token_start:len(ids)],
                        req.logprobs, offsets[index])
                offsets[index] += len(d.text)
                yield chunk([CompletionChoice(index=index, text=d.text, logprobs=lp,
                                              finish_reason=d.finish_reason)])  # type: ignore[arg-type]
            if out.finished:
                finals[i] = out
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage_of([f for f in finals if f is not None]))
        yield SSE_DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 -- headers are sent; report it in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_unfinished(state, streams)
