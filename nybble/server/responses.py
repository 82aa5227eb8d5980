"""Pydantic models of the OpenAI-compatible API's answers: responses, stream chunks, errors."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens`` are prompt tokens whose
    K/V came from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a response (prompt counted once per prompt, not per sample)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    """Completions-style logprobs of one choice (parallel lists, one entry per token)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (or of a completion stream chunk)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(BaseModel):
    """``text_completion`` response and ``text_completion`` stream chunks."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token in chat-format logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """One generated token in chat-format logprobs, with its top alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """Chat-format logprobs of one choice."""

    content: list[ChatTokenLogprob] | None = None


def _without_none(data: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data`` without its ``None`` values, except the keys in ``keep`` (OpenAI omits absent
    fields instead of sending null)."""
    return {k: v for k, v in data.items() if v is not None or k in keep}


class FunctionCall(BaseModel):
    """``function`` of a tool call: ``arguments`` is the JSON text the model wrote."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message (``id`` like ``call_...``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class AssistantMessage(BaseModel):
    """The generated message of a chat choice: ``content`` (``null`` when the answer is
    only tool calls), ``tool_calls`` when the model called tools, and ``reasoning_content``
    (with ``reasoning``, vLLM's newer name) with ``--reasoning-parser``; the last two are
    left out when absent."""

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self), keep=("content",))


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    """``chat.completion`` response."""

    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    """``function`` of a streamed tool call: ``name`` in the call's first delta, then
    ``arguments`` fragments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self))


class DeltaToolCall(BaseModel):
    """One ``delta.tool_calls`` entry (OpenAI's stream shape): ``index`` always; ``id``,
    ``type`` and the name only in the call's first one."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self))


class DeltaMessage(BaseModel):
    """Incremental message of a chat stream chunk (role only in a choice's first chunk)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # NOTE: OpenAI omits absent delta fields instead of sending null
        return _without_none(handler(self))


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """``chat.completion.chunk``; the usage chunk has empty ``choices``."""

    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nybble"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models`` response."""

    object: str = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    """``GET /version``."""

    version: str


class TokenizeResponse(BaseModel):
    """``POST /tokenize`` (vLLM's shape; ``token_strs`` is always null)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    prompt: str


class ErrorInfo(BaseModel):
    """The ``error`` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo

    def body(self) -> dict[str, Any]:
        """The JSON-ready dict."""
        return self.model_dump()
