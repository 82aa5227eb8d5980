"""The request models: an explicit null is the field left out, types are strict, lone
surrogates and non-text content parts are refused, and the JSON schema says all of it."""
from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from nybble.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

REQUIRED: dict[type[BaseModel], dict[str, Any]] = {
    CompletionRequest: {"prompt": "Hi"},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "Hi"}]},
    TokenizeRequest: {},
    DetokenizeRequest: {"tokens": [1]},
}


def _optional_fields(model: type[BaseModel]) -> list[str]:
    """Optional fields whose ``null`` is the default (not those in ``NULL_IS_VALUE``)."""
    keep = getattr(model, "NULL_IS_VALUE", frozenset())
    return [name for name, f in model.model_fields.items()
            if not f.is_required() and name not in keep]


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_every_optional_field_null_is_the_default(model: type[BaseModel]) -> None:
    base = model.model_validate(REQUIRED[model])
    fields = _optional_fields(model)
    assert fields
    for name in fields:
        assert model.model_validate({**REQUIRED[model], name: None}) == base, name
    everything_null = model.model_validate({**REQUIRED[model], **dict.fromkeys(fields)})
    assert everything_null == base


def test_max_tokens_left_out_is_16_for_completions_and_null_is_the_rest() -> None:
    """vLLM: completions' ``max_tokens`` left out is 16, ``null`` the rest of the context
    (resolved per prompt by the gate); chat's is the rest either way."""
    assert CompletionRequest.model_validate({"prompt": "Hi"}).max_tokens == 16
    assert CompletionRequest.model_validate({"prompt": "Hi", "max_tokens": None}).max_tokens \
        is None
    chat = ChatCompletionRequest.model_validate({**REQUIRED[ChatCompletionRequest],
                                                 "max_tokens": None, "logprobs": None})
    assert chat.max_tokens is None and chat.logprobs is False
    message = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "assistant", "content": None, "name": None}]}).messages[0]
    assert message.text() == "" and message.name is None


@pytest.mark.parametrize("field,value", [("n", 1.0), ("n", "1"), ("max_tokens", 2.5),
                                         ("stream", 1), ("echo", "true"), ("prompt", 5),
                                         ("stop", 3), ("temperature", "0.5"),
                                         ("stop_token_ids", ["1"])])
def test_types_are_strict(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "Hi", field: value})
    assert info.value.errors()[0]["loc"][0] == field


def test_a_float_field_takes_an_integer() -> None:
    assert CompletionRequest.model_validate({"prompt": "Hi", "temperature": 1}).temperature == 1


@pytest.mark.parametrize("body,field", [
    ({"prompt": "Hi \ud800"}, "prompt"),
    ({"prompt": ["ok", "\udfff"]}, "prompt"),
    ({"prompt": "Hi", "model": "\udc00"}, "model"),
    ({"prompt": "Hi", "stop": ["a", "b\ud83d"]}, "stop"),
    ({"prompt": "Hi", "user": "\ud800x"}, "user"),
])
def test_lone_surrogates_are_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert cause.param == field and "lone surrogate" in str(cause)


def test_surrogates_in_messages_and_keys_are_refused() -> None:
    for messages in ([{"role": "user", "content": "\ud800"}],
                     [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]):
        with pytest.raises(ValidationError, match="lone surrogate"):
            ChatCompletionRequest.model_validate({"messages": messages})
    with pytest.raises(ValidationError, match="lone surrogate"):
        TokenizeRequest.model_validate({"prompt": "x", "\ud800": 1})
    # a valid pair (an emoji written as two escapes) is one character, accepted
    ok = CompletionRequest.model_validate(json.loads('{"prompt": "\\ud83d\\ude42"}'))
    assert ok.prompt == "🙂"


@pytest.mark.parametrize("part", ["image_url", "input_audio", "file", "refusal"])
def test_content_parts_other_than_text_are_refused_by_type(part: str) -> None:
    for model in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(ValidationError) as info:
            model.model_validate({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look:"}, {"type": part, part: {"url": "x"}}]}]})
        (error,) = info.value.errors()
        assert repr(part) in error["msg"] and error["loc"][0] == "messages"
    ok = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"text": "b"}]}]})
    assert ok.messages[0].text() == "ab"


@pytest.mark.parametrize("content,match", [
    ([{"type": "text"}], "needs a 'text' string, got None"),
    ([{"type": "text", "text": None}], "needs a 'text' string, got None"),
    ([{"type": "text", "text": 5}], "needs a 'text' string, got 5"),
    ([], "non-empty list of text parts, got \\[\\]"),
])
def test_a_text_part_needs_its_text_and_a_list_a_part(content: list, match: str) -> None:
    for model in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(ValidationError, match=match) as info:
            model.model_validate({"messages": [{"role": "user", "content": content}]})
        (error,) = info.value.errors()   # one readable message, not pydantic's union list
        assert error["loc"][0] == "messages"


def test_stream_options_need_stream() -> None:
    with pytest.raises(ValidationError, match="stream_options is only allowed with stream"):
        CompletionRequest.model_validate({"prompt": "Hi",
                                          "stream_options": {"include_usage": True}})
    with pytest.raises(ValidationError, match="stream_options"):
        ChatCompletionRequest.model_validate({**REQUIRED[ChatCompletionRequest],
                                              "stream": False, "stream_options": {}})
    ok = CompletionRequest.model_validate({"prompt": "Hi", "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert ok.stream_options is not None and ok.stream_options.include_usage


@pytest.mark.parametrize("prompt", [list(range(5, 50)), [[5, 6], [7]], ["a", "b"], "text"])
def test_every_prompt_form_is_kept(prompt: Any) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("prompt", [[1, "a"], ["a", 1], [[1], 2], [], 3.5])
def test_mixed_or_empty_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": prompt})
    assert info.value.errors()[0]["loc"][0] == "prompt"


@pytest.mark.parametrize("prompt", [123, 3.5, True, {"text": "a"}])
def test_a_prompt_of_another_type_is_refused_naming_the_forms(prompt: Any) -> None:
    """Not a string or a list: one error at ``prompt`` listing the four forms (not an internal
    union tag such as ``prompt.ids``)."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": prompt})
    (err,) = info.value.errors()
    assert err["loc"] == ("prompt",)
    assert err["msg"] == ("must be a string, a list of strings, a list of token ids or a list "
                          "of token-id lists")       # shown as "prompt: must be ..."


def _message(model: type[BaseModel], body: dict) -> str:
    """The error message the server sends for ``body`` (``_validation_message`` on the
    request's validation errors, located under ``body`` as FastAPI does)."""
    from fastapi.exceptions import RequestValidationError

    from nybble.server.errors import _validation_message

    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [dict(e, loc=("body", *e["loc"])) for e in info.value.errors()]
    return _validation_message(RequestValidationError(errors))[0]


@pytest.mark.parametrize("prompt,want", [
    ([1, "a"], "prompt.1: Input should be a valid integer (read as a list of token ids)"),
    (["a", 1], "prompt.1: Input should be a valid string (read as a list of strings)"),
    ([[1], 2], "prompt.1: Input should be a valid list (read as a list of token-id lists)"),
])
def test_a_mixed_prompt_names_the_element_and_the_form_not_a_union_tag(prompt: Any,
                                                                       want: str) -> None:
    assert _message(CompletionRequest, {"prompt": prompt}) == f"invalid request: {want}"


def test_union_member_labels_stay_out_of_error_locations() -> None:
    """pydantic locates a union's errors under each member's label (``content.str``,
    ``content.list[ContentPart]``): one location, its messages joined."""
    body = {"messages": [{"role": "user", "content": 5}]}
    assert _message(ChatCompletionRequest, body) == (
        "invalid request: messages.0.content: Input should be a valid string or a valid list")
    assert _message(CompletionRequest, {"prompt": "a", "stop": [1]}) == (
        "invalid request: stop: Input should be a valid string; stop.0: Input should be a "
        "valid string")


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_schema_marks_every_optional_field_nullable(model: type[BaseModel]) -> None:
    props = model.model_json_schema()["properties"]
    for name in _optional_fields(model):
        options = props[name].get("anyOf", [props[name]])
        assert {"type": "null"} in options, name


def test_schema_lists_text_as_the_only_content_part() -> None:
    defs = ChatCompletionRequest.model_json_schema()["$defs"]
    assert defs["ContentPart"]["properties"]["type"]["anyOf"][0]["enum"] == ["text"]


def test_stop_strings_are_capped() -> None:
    from nybble.server.protocol import MAX_STOP_STRINGS

    ok = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert CompletionRequest.model_validate({"prompt": "Hi", "stop": ok}).stop == ok
    with pytest.raises(ValidationError, match=f"at most {MAX_STOP_STRINGS} strings, got 65"):
        CompletionRequest.model_validate({"prompt": "Hi", "stop": [*ok, "one more"]})
