"""Pydantic models of the OpenAI-compatible API's requests (answers: ``responses.py``).

Requests carry types and shapes only: every value range (temperature, ``max_tokens`` against
the context, ``logprobs``, ``seed``, token ids...) is checked once, by the engine's request
gate (:mod:`nybble.runtime.input_processor`; ``InvalidRequestError`` -> 400). Unknown request
fields are ignored, as OpenAI clients send fields nybble does not use (``user``,
``metadata``, ...); the fields nybble does not implement (penalties, ``logit_bias``,
``best_of`` other than ``n``, ``suffix``, ``tools``, non-text ``response_format``, ``echo`` with
``logprobs``) are declared, and the validators below refuse a non-neutral value with a 400
naming the field instead of silently ignoring it: this is the one place such refusals live.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


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
    # Not implemented: only their neutral values are accepted (the validators below).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    suffix: str | None = None

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty")
    @classmethod
    def _neutral_penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        neutral = 1.0 if info.field_name == "repetition_penalty" else 0.0
        if value is not None and value != neutral:
            raise ValueError(f"{info.field_name} is not supported by nybble: it must be "
                             f"{neutral} or absent, got {value}")
        return value

    @field_validator("logit_bias", "tools", "suffix")
    @classmethod
    def _empty(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            got = repr(value) if isinstance(value, str) else f"{len(value)} entries"
            raise ValueError(f"{info.field_name} is not supported by nybble: it must be empty "
                             f"or absent, got {got}")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if value is not None and n is not None and value != n:
            raise ValueError(f"best_of is not supported by nybble: it must equal n ({n}) or "
                             f"be absent, got {value}")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type", "text") != "text":
            raise ValueError(f"response_format must be {{'type': 'text'}} or absent (nybble "
                             f"has no guided decoding), got {value}")
        return value


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body.

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists;
    each prompt yields ``n`` choices, numbered ``prompt_index * n + sample_index``.
    ``logprobs``: top-N log-probabilities per generated token.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False    # NOTE: after logprobs, so that its validator sees logprobs

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must be non-empty, got []")
        return value

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs is not supported (nybble does not compute "
                             "prompt logprobs)")
        return value


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

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must be a non-empty list, got []")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


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
