"""``POST /v1/chat/completions``: chat template -> the completions core; role delta first."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from nybble.errors import InvalidRequestError
from nybble.outputs import RequestOutput
from nybble.runtime.async_engine import RequestStream
from nybble.server.auth import require_api_key
from nybble.server.logprobs import TokenDecoder, chat_logprobs
from nybble.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from nybble.server.serving import (
    CLIENT_CLOSED,
    SSE_DONE,
    DeltaTracker,
    abort_unfinished,
    arrival,
    check_prompt_ids,
    collect,
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


def render_chat(state: ServerState, messages: list[ChatMessage],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    The template already emits BOS, so the rendered text is tokenized without adding special
    tokens again.

    Raises:
        InvalidRequestError: no messages, or the tokenizer has no chat template.
    """
    if not messages:
        raise InvalidRequestError("messages must be a non-empty list, got []", param="messages")
    if not getattr(state.tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; use "
                                  "/v1/completions", param="messages")
    text = state.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text()} for m in messages],
        add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = list(state.tokenizer(text, add_special_tokens=False)["input_ids"])
    check_prompt_ids(ids, state, param="messages")
    return ids


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(req: ChatCompletionRequest, request: Request
                                 ) -> ChatCompletionResponse | Response:
    """OpenAI chat completions over the served model (``n`` choices, indices ``0..n-1``).

    Raises:
        InvalidRequestError: a bad parameter or a conversation too long (400).
        ModelNotFoundError: ``model`` is not the served model (404).
    """
    t0 = arrival()
    state = get_state(request)
    state.check_model(req.model)
    ids = render_chat(state, req.messages)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_tokens = resolve_max_tokens(len(ids), requested, state, param=param)
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    params = sampling_params(req, max_tokens, top, state)
    request_id = new_id("chatcmpl")
    streams = await submit(state, request_id, [ids], params, t0)
    if req.stream:
        return StreamingResponse(_stream(state, req, request_id, streams[0], top),
                                 media_type="text/event-stream")
    finals = await collect(request, state, streams)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    return _response(state, request_id, finals[0], top)


def _response(state: ServerState, request_id: str, final: RequestOutput,
              top: int | None) -> ChatCompletionResponse:
    decoder = TokenDecoder(state.tokenizer)
    choices = []
    for o in final.outputs:
        lp = None
        if top is not None and o.logprobs is not None:
            lp = chat_logprobs(decoder, final.prompt_token_ids, o.token_ids, o.logprobs, top)
        choices.append(ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                                  logprobs=lp, finish_reason=o.finish_reason))  # type: ignore[arg-type]
    choices.sort(key=lambda c: c.index)
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=usage_of([final]))


async def _stream(state: ServerState, req: ChatCompletionRequest, request_id: str,
                  stream: RequestStream, top: int | None) -> AsyncIterator[str]:
    """SSE: a role delta per choice, content deltas, a chunk with ``finish_reason``, optional
    usage chunk (empty choices), then ``[DONE]``."""
    def chunk(choices: list[ChatStreamChoice], usage: object = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=state.model_name, choices=choices,
                                       usage=usage))  # type: ignore[arg-type]

    decoder = TokenDecoder(state.tokenizer)
    tracker = DeltaTracker()
    final: RequestOutput | None = None
    try:
        for j in range(req.n):
            yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant",
                                                                      content=""))])
        async for out in stream:
            for d in tracker.deltas(0, out):
                lp = None
                if top is not None and d.output.logprobs is not None:
                    ids = d.output.token_ids
                    lp = chat_logprobs(decoder, out.prompt_token_ids + ids[:d.token_start],
                                       ids[d.token_start:],
                                       d.output.logprobs[d.token_start:len(ids)], top)
                delta = DeltaMessage(content=d.text) if d.text else DeltaMessage()
                yield chunk([ChatStreamChoice(index=d.output.index, delta=delta, logprobs=lp,
                                              finish_reason=d.finish_reason)])  # type: ignore[arg-type]
            if out.finished:
                final = out
        if req.stream_options is not None and req.stream_options.include_usage \
                and final is not None:
            yield chunk([], usage_of([final]))
        yield SSE_DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 -- headers are sent; report it in-band
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        abort_unfinished(state, [stream])
