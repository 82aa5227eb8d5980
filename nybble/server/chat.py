"""``POST /v1/chat/completions``: chat template -> the serving pipeline; chat-shaped chunks."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from nybble.errors import InvalidRequestError
from nybble.outputs import CompletionOutput, RequestOutput
from nybble.runtime.frontend.input_processor import ParamNames
from nybble.server.auth import require_api_key
from nybble.server.chat_output import (
    SampleParts,
    finish_reason,
    reasoning_parser,
    whole_message,
)
from nybble.server.logprobs import SampleDecoder, chat_logprobs
from nybble.server.openapi import generation_responses
from nybble.server.protocol import ChatCompletionRequest
from nybble.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
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
from nybble.server.tool_choice import ToolPlan, plan_tools, remap_grammar_error
from nybble.server.tool_parsers.streaming import CallDelta

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
    plan = plan_tools(req, state.config)
    params = sampling_params(req, getattr(req, budget), top,
                             defaults=state.sampling_defaults)
    if plan.guided is not None:
        params.guided_decoding = plan.guided
    if plan.keeps_special_tokens:
        params.skip_special_tokens = False
    names = ParamNames(prompt="messages", max_tokens=budget, logprobs="top_logprobs")
    renderer = ChatRenderer(state, req, new_id("chatcmpl", request), top, plan)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    try:
        lora = state.lora_request(req.model)
        return await serve(request, state, renderer, params, names, t0, req.stream,
                           include_usage, lora)  # type: ignore[return-value]
    except InvalidRequestError as e:   # NOTE: a tools grammar the core refused: name tools
        raise remap_grammar_error(plan, e) from None


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
                 top: int | None, plan: ToolPlan) -> None:
        self.state, self.req, self.request_id, self.top = state, req, request_id, top
        self.model_name = state.response_model(req.model)
        self.plan = plan
        self.logprobs = top is not None
        self.echo = echo_text(req)
        self.reasoning = reasoning_parser(state.config.reasoning_parser, plan)
        self._samples: dict[int, SampleParts] = {}

    def prompts(self) -> list[str | list[int]]:
        """The conversation rendered with the chat template, as token ids."""
        return [render_chat(self.state, self.req, self.req.messages)]

    def text_offsets(self) -> None:
        """Chat choices start empty."""
        return

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.request_id, model=self.model_name,
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
        """The chunks of one sample's delta: its reasoning, content and tool-call deltas
        (one chunk each, OpenAI's shapes); the finish reason (``tool_calls`` after calls)
        rides on the last. Text a parser holds back (possible markup) makes no chunk, unless
        logprobs or the finish reason must go out (then an empty delta carries them)."""
        lp = None
        if self.top is not None and delta.logprobs:
            lp = chat_logprobs(delta.decoder, delta.token_ids, delta.logprobs, self.top)
        sample = self._samples.get(delta.index)
        if sample is None:
            sample = self._samples[delta.index] = SampleParts(self.plan, self.reasoning)
        parts = sample.push(delta.text, delta.finish_reason is not None)
        messages = []
        if parts.reasoning:
            messages.append(DeltaMessage(reasoning_content=parts.reasoning,
                                         reasoning=parts.reasoning))
        if parts.content:
            messages.append(DeltaMessage(content=parts.content))
        messages += [DeltaMessage(tool_calls=[_call_delta(c)]) for c in parts.calls]
        if not messages and (lp is not None or delta.finish_reason is not None):
            messages.append(DeltaMessage())
        reason = finish_reason(delta.finish_reason, sample.num_calls)
        return "".join(
            self._chunk([ChatStreamChoice(
                index=delta.index, delta=m, logprobs=lp if k == 0 else None,
                finish_reason=reason if k == len(messages) - 1 else None)])  # type: ignore[arg-type]
            for k, m in enumerate(messages))

    def usage_chunk(self, usage: UsageInfo) -> str:
        """The usage chunk (empty ``choices``)."""
        return self._chunk([], usage)

    def response(self, finals: list[RequestOutput]) -> Response:
        """The ``chat.completion`` object (choices built and serialized one at a time)."""
        final = finals[0]
        head = ChatCompletionResponse(id=self.request_id, model=self.model_name,
                                      choices=[], usage=usage_of(finals))
        return json_response(head, (self._choice(final, o) for o in final.outputs))

    def _choice(self, final: RequestOutput, o: CompletionOutput) -> ChatChoice:
        lp = None
        if self.top is not None and o.logprobs is not None:
            decoder = SampleDecoder(self.state.tokenizer, final.prompt_token_ids)
            lp = chat_logprobs(decoder, o.token_ids, o.logprobs, self.top)
        message = whole_message(o.text, self.plan, self.reasoning, self.echo)
        return ChatChoice(index=o.index, message=message, logprobs=lp,
                          finish_reason=finish_reason(o.finish_reason,
                                                      len(message.tool_calls or ())))  # type: ignore[arg-type]


def _call_delta(c: CallDelta) -> DeltaToolCall:
    """A streamed call's entry: the first carries id, type and name (arguments ``""``)."""
    if c.id is not None:
        return DeltaToolCall(index=c.index, id=c.id, type="function",
                             function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
    return DeltaToolCall(index=c.index, function=DeltaFunctionCall(arguments=c.arguments))
