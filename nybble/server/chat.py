"""``POST /v1/chat/completions``: chat template -> the serving pipeline; chat-shaped chunks."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nybble.outputs import CompletionOutput, RequestOutput
from nybble.runtime.frontend.input_processor import ParamNames
from nybble.server.auth import require_api_key
from nybble.server.logprobs import SampleDecoder, chat_logprobs
from nybble.server.openapi import generation_responses
from nybble.server.protocol import ChatCompletionRequest
from nybble.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from nybble.server.serving import (
    arrival,
    json_response,
    new_id,
    render_chat,
    sampling_params,
    serve,
)
from nybble.server.state import ServerState, get_state, wait_ready
from nybble.server.streams import Delta, sse, usage_of

router = APIRouter(dependencies=[Depends(require_api_key), Depends(wait_ready)])


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def create_chat_completion(req: ChatCompletionRequest, request: Request
                                 ) -> ChatCompletionResponse | Response:
    """OpenAI chat completions over the served model (``n`` choices, indices ``0..n-1``).

    With ``stream: true`` the answer is server-sent events (``text/event-stream``): one
    ``chat.completion.chunk`` JSON object per ``data:`` line, then ``data: [DONE]``.

    Raises:
        InvalidRequestError: a bad parameter or a conversation too long (400).
        ModelNotFoundError: ``model`` is not the served model (404).
    """
    t0 = arrival()
    state = get_state(request)
    state.check_model(req.model)
    budget = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, getattr(req, budget), top)
    names = ParamNames(prompt="messages", max_tokens=budget, logprobs="top_logprobs")
    renderer = ChatRenderer(state, req, new_id("chatcmpl"), top)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return await serve(request, state, renderer, params, names, t0, req.stream,
                       include_usage)  # type: ignore[return-value]


def echo_text(req: ChatCompletionRequest) -> str:
    """What ``echo`` puts before each choice's content (vLLM's rule): the final message's
    text when it has the answer's role (the assistant's with ``add_generation_prompt``,
    else any), else ``""``."""
    last = req.messages[-1]
    if not req.echo or (req.add_generation_prompt and last.role != "assistant"):
        return ""
    return last.text()


class ChatRenderer:
    """Chat chunk and response shapes (one prompt; a role delta per choice first).

    Args:
        top: ``top_logprobs`` per token, or ``None`` when ``logprobs`` is off.
    """

    def __init__(self, state: ServerState, req: ChatCompletionRequest, request_id: str,
                 top: int | None) -> None:
        self.state, self.req, self.request_id, self.top = state, req, request_id, top
        self.logprobs = top is not None
        self.echo = echo_text(req)

    def prompts(self) -> list[str | list[int]]:
        """The conversation rendered with the chat template, as token ids."""
        return [render_chat(self.state, self.req, self.req.messages)]

    def text_offsets(self) -> None:
        """Chat choices start empty."""
        return

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.request_id, model=self.state.model_name,
                                       choices=choices, usage=usage))

    def preamble(self) -> list[str]:
        """A role delta for every choice, then (``echo``) the echoed text of each."""
        events = [self._chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant",
                                                                            content=""))])
                  for j in range(self.req.n)]
        if self.echo:
            events += [self._chunk([ChatStreamChoice(index=j,
                                                     delta=DeltaMessage(content=self.echo))])
                       for j in range(self.req.n)]
        return events

    def delta_chunk(self, prompt_index: int, delta: Delta) -> str:
        """A content delta (empty only in a choice's last chunk, when only the finish reason
        is new)."""
        lp = None
        if self.top is not None and delta.logprobs:
            lp = chat_logprobs(delta.decoder, delta.token_ids, delta.logprobs, self.top)
        message = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
        return self._chunk([ChatStreamChoice(index=delta.index, delta=message, logprobs=lp,
                                             finish_reason=delta.finish_reason)])  # type: ignore[arg-type]

    def usage_chunk(self, usage: UsageInfo) -> str:
        """The usage chunk (empty ``choices``)."""
        return self._chunk([], usage)

    def response(self, finals: list[RequestOutput]) -> Response:
        """The ``chat.completion`` object (choices built and serialized one at a time)."""
        final = finals[0]
        head = ChatCompletionResponse(id=self.request_id, model=self.state.model_name,
                                      choices=[], usage=usage_of(finals))
        return json_response(head, (self._choice(final, o) for o in final.outputs))

    def _choice(self, final: RequestOutput, o: CompletionOutput) -> ChatChoice:
        lp = None
        if self.top is not None and o.logprobs is not None:
            decoder = SampleDecoder(self.state.tokenizer, final.prompt_token_ids)
            lp = chat_logprobs(decoder, o.token_ids, o.logprobs, self.top)
        return ChatChoice(index=o.index, message=AssistantMessage(content=self.echo + o.text),
                          logprobs=lp,
                          finish_reason=o.finish_reason)  # type: ignore[arg-type]
