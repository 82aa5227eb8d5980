"""Pydantic models of the OpenAI-compatible API's requests (answers: ``responses.py``).

Requests carry types and shapes only: every value range (temperature, ``max_tokens`` against
the context, ``logprobs``, ``seed``, token ids...) is checked once, by the engine's request
gate (:mod:`nybble.runtime.frontend.input_processor`; ``InvalidRequestError`` -> 400). Unknown
request
fields are ignored, as OpenAI clients send fields nybble does not use (``user``,
``metadata``, ...); the fields nybble does not implement (``suffix``, ``tools``, ``best_of``
other than ``n`` or ``echo`` with ``logprobs`` when streaming, content parts other than
``text``) are declared, and the validators below refuse a non-neutral value with a 400 naming
the field instead of silently ignoring it: this is the one place such refusals live.
Tool calling (chat ``tools``, ``tool_choice``, ``parallel_tool_calls``) is declared here
with its shapes; what the tools and the tool choice must be is checked by
:mod:`nybble.server.tool_choice`.

Every model here derives from :class:`RequestModel` (``request_base.py``): strict types,
``null`` = omitted, nullable optional fields in the schema, valid Unicode only.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nybble.errors import InvalidRequestError
from nybble.server.request_base import RequestBody, RequestModel


MAX_STOP_STRINGS = 64
"""Most ``stop`` strings per request: each generated token is matched against every one on
the API process's event loop (100,000 of them cost 56 ms per token; OpenAI allows 4)."""


class StreamOptions(RequestModel):
    """``stream_options``: ``include_usage`` adds a final chunk with usage, empty choices."""

    include_usage: bool = False


class _SamplingFields(RequestBody):
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
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None    # NOTE: after stream (its validator)
    user: str | None = None
    # Logit shaping (OpenAI + vLLM names; ranges checked by the request gate).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # Structured output: OpenAI's response_format, vLLM's guided_* extras.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # Not implemented: only their neutral values are accepted (the validators below).
    suffix: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true (OpenAI's "
                             "rule), got stream_options without it")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got "
                             f"{len(value)}")
        return value

    @field_validator("suffix")
    @classmethod
    def _empty(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            got = repr(value) if isinstance(value, str) else f"{len(value)} entries"
            raise ValueError(f"{info.field_name} is not supported by nybble: it must be empty "
                             f"or absent, got {got}")
        return value

    @model_validator(mode="after")
    def _best_of_not_streamed(self) -> Any:
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of must equal n ({self.n}) or be absent with "
                                      f"stream: true (the best samples are known only at the "
                                      f"end), got {self.best_of}", param="best_of")
        return self

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = value.get("type", "text") if value else "text"
        if kind not in RESPONSE_FORMATS:
            raise ValueError(f"response_format type must be one of {list(RESPONSE_FORMATS)}, "
                             f"got {kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema") if value else None
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("response_format json_schema must be an object with a "
                                 "'schema' object, got " + repr(spec)[:200])
        return value


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
"""The ``response_format`` types the server accepts (OpenAI's)."""


def _prompt_kind(value: Any) -> str | None:
    """Which form a ``prompt`` takes, from its first element (so that validating a long
    token-id list tries one form only, not each of the union's in turn); None for a value
    that is neither a string nor a list (the Discriminator's own error then names the forms)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if isinstance(value, list) and value else None
    return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) \
        else "ids"


PROMPT_FORMS = {"text": "a string", "texts": "a list of strings", "ids": "a list of token ids",
                "id_lists": "a list of token-id lists"}
"""The union tags of :data:`Prompt` (they appear in pydantic's error locations) and the form
each stands for."""

Prompt = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")]
    | Annotated[list[int], Tag("ids")] | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="must be a string, a list of strings, a list of "
                                       "token ids or a list of token-id lists")]
"""A completions prompt: a string, strings, token ids, or lists of token ids."""


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body.

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists;
    each prompt yields ``n`` choices, numbered ``prompt_index * n + sample_index``.
    ``logprobs``: top-N log-probabilities per generated token, and per prompt token with
    ``echo`` (prompt logprobs; the first prompt token's is ``null``). ``max_tokens: 0``
    generates nothing (scoring: with ``echo``, only the prompt comes back).
    ``max_tokens`` left out is 16 (OpenAI); ``null`` is the rest of each prompt's own
    context (vLLM).
    ``use_beam_search`` (vLLM's extra parameter): ``n`` beams, all returned best first;
    ``length_penalty`` and ``early_stopping`` as in transformers (docs/serving.md, "Beam
    search"); the gate checks them.
    """

    NULL_IS_VALUE: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    tools: list[dict[str, Any]] | None = None   # chat only: refused here (below)

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError(f"tools is only supported by /v1/chat/completions: it must be "
                             f"empty or absent here, got {len(value)} entries")
        return value

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must be non-empty, got []")
        return value

    @model_validator(mode="after")
    def _no_streamed_prompt_logprobs(self) -> Any:
        if self.stream and self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported with stream: true "
                                      "(prompt logprobs are returned in the whole response "
                                      "only)", param="echo")
        return self


class ContentPart(RequestModel):
    """One part of a message's content; only ``text`` parts are supported (the served models
    read text only): :class:`ChatMessage` refuses any other ``type`` with a 400 naming it."""

    type: str = Field("text", json_schema_extra={"enum": ["text"]})
    text: str   # required, as in OpenAI's text part: a part without it is a 400


class FunctionCallIn(RequestModel):
    """``function`` of an assistant message's tool call: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCallIn(RequestModel):
    """One tool call of an assistant message in the history (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    """One chat message (``role`` and string or text-part ``content``).

    An assistant message may carry ``tool_calls`` (its ``content`` then may be ``null``); a
    ``tool`` message answers one of them by ``tool_call_id``.
    """

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template's input (OpenAI's dict shape; text parts
        joined; :func:`nybble.tokenizer.chat_messages.template_messages` converts it)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # NOTE: here rather than on ContentPart, so the 400 says only this (not also why
        # the list is not a string)
        parts = data.get("content") if isinstance(data, dict) else None
        role = data.get("role") if isinstance(data, dict) else None
        if parts is None and isinstance(role, str) and role != "assistant":
            # NOTE: only an assistant turn may leave content out (it then carries tool_calls)
            raise ValueError(f"content of a {role!r} message must be a string or a list of "
                             f"text parts, got null")
        if parts == []:
            raise ValueError("content must be a string or a non-empty list of text parts, "
                             "got []")
        for part in parts if isinstance(parts, list) else ():
            kind = part.get("type", "text") if isinstance(part, dict) else "text"
            if kind != "text":
                raise ValueError(f"content part type must be 'text' (nybble serves text-only "
                                 f"models), got {kind!r}")
            if isinstance(part, dict) and not isinstance(part.get("text"), str):
                raise ValueError(f"a content part of type 'text' needs a 'text' string, got "
                                 f"{part.get('text')!r}")
        return data

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatOptions(RequestBody):
    """vLLM's options of how ``messages`` become the prompt (chat completions, ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None   # checked by nybble.server.tool_choice

    @model_validator(mode="after")
    def _one_way_to_end(self) -> Any:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt must "
                                      "not both be true (set add_generation_prompt to false "
                                      "to continue the final message)",
                                      param="continue_final_message")
        return self


class ChatCompletionRequest(_SamplingFields, ChatOptions):
    """``POST /v1/chat/completions`` body; ``max_completion_tokens`` wins over ``max_tokens``.

    vLLM's chat options: ``add_generation_prompt`` (default true), ``continue_final_message``
    (assistant prefill: the final message is continued, not closed; not with
    ``add_generation_prompt``), ``chat_template`` (a jinja2 template replacing the model's),
    ``chat_template_kwargs`` (extra template variables) and ``echo`` (the final message, when
    it is the assistant's, leads each choice's content).

    Tool calling (OpenAI's): ``tools`` (function schemas, given to the chat template),
    ``tool_choice`` (``none``, ``auto``, ``required`` or ``{"type": "function", "function":
    {"name": ...}}``; default ``auto`` with tools, else ``none``) and ``parallel_tool_calls``
    (``required`` may make several calls; default true). See :mod:`nybble.server.tool_choice`.
    """

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's beam-search fields: declared so that they are refused here (below), not ignored
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    @model_validator(mode="after")
    def _no_beam_search(self) -> Any:
        """Beam search runs on ``/v1/completions`` (and ``LLM.beam_search``) only."""
        if self.use_beam_search:
            raise InvalidRequestError("use_beam_search is not supported by "
                                      "/v1/chat/completions; use /v1/completions with the "
                                      "chat template applied, or LLM.beam_search offline",
                                      param="use_beam_search")
        if self.length_penalty not in (None, 1.0):
            raise InvalidRequestError(f"length_penalty must be 1.0 or absent: it is a "
                                      f"beam-search field, and /v1/chat/completions has no "
                                      f"beam search, got {self.length_penalty}",
                                      param="length_penalty")
        if self.early_stopping not in (None, False):
            raise InvalidRequestError(f"early_stopping must be false or absent: it is a "
                                      f"beam-search field, and /v1/chat/completions has no "
                                      f"beam search, got {self.early_stopping!r}",
                                      param="early_stopping")
        return self

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


class TokenizeRequest(ChatOptions):
    """``POST /tokenize`` (vLLM): either ``prompt`` or chat ``messages`` (with the chat
    options of :class:`ChatOptions`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestBody):
    """``POST /detokenize`` (vLLM)."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestBody):
    """``POST /v1/load_lora_adapter`` (vLLM): serve the PEFT folder ``lora_path`` as
    ``lora_name``."""

    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(RequestBody):
    """``POST /v1/unload_lora_adapter`` (vLLM): stop serving ``lora_name`` (``lora_int_id``
    is accepted and ignored: names identify adapters here)."""

    lora_name: str
    lora_int_id: int | None = None
