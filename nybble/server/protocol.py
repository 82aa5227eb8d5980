"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Requests carry types only; value ranges are checked once, by :class:`SamplingParams`
(``InvalidRequestError`` -> 400). Unknown request fields are ignored, as OpenAI clients send
fields nybble does not use (``user``, ``metadata``, ...); the sampling controls nybble does not
implement (penalties, ``logit_bias``, ``best_of`` > ``n``) are declared so that a non-default
value is refused with a 400 instead of silently ignored.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage, empty choices."""

    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI + vLLM extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Not implemented: only their neutral values are accepted (see serving.sampling_params).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    suffix: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body.

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists;
    each prompt yields ``n`` choices, numbered ``prompt_index * n + sample_index``.
    ``logprobs``: top-N log-probabilities per generated token.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None


class ContentPart(_Request):
    """One part of a message's content; only ``text`` parts are supported."""

    type: str = "text"
    text: str = ""


class ChatMessage(_Request):
    """One chat message (``role`` and string or text-part ``content``)."""

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body; ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM): either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM)."""

    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    """Token counts of a response (prompt counted once per prompt, not per sample)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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


class AssistantMessage(BaseModel):
    """The generated message of a chat choice."""

    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatCompletionResponse(BaseModel):
    """``chat.completion`` response."""

    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """Incremental message of a chat stream chunk (role only in a choice's first chunk)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # NOTE: OpenAI omits absent delta fields instead of sending null
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


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
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models`` response."""

    object: str = "list"
    data: list[ModelCard]


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
