"""Tool calling and reasoning through a real ``nybble serve`` with the official openai client.

The server runs the bundled story model with a Hermes-style tool template
(``tool_template.jinja``), ``--enable-auto-tool-choice --tool-call-parser hermes`` and
``--reasoning-parser qwen3``. The model knows nothing of tools, so the calls come from
the structured-output path (named and ``required`` tool choice) or, for the ``auto`` parser
and the reasoning split, from a ``guided_regex`` that makes the model write the markup.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, Server, start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

TEMPLATE = Path(__file__).with_name("tool_template.jinja")
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with tool calling and reasoning on."""
    log_path = tmp_path_factory.mktemp("tools") / "serve.log"
    proc, url = start_server(log_path, "--api-key", API_KEY, "--chat-template", str(TEMPLATE),
                             "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                             "--reasoning-parser", "qwen3")
    try:
        yield Server(url=url, api_key=API_KEY, log_path=log_path, pid=proc.pid)
    finally:
        stop_server(proc)


@pytest.fixture()
def tc(tool_server: Server) -> openai.OpenAI:
    return tool_server.openai()


def _create(client: openai.OpenAI, **kw: Any) -> Any:
    body = {"model": "stories260k", "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
            "max_tokens": 120, **kw}
    return client.chat.completions.create(**body)


def _assemble(stream: Any) -> tuple[str, str, list[tuple[str, str, str]], str | None]:
    """(content, reasoning, [(id, name, arguments)], finish_reason) of a stream, checking
    OpenAI's delta shapes on the way."""
    content, reasoning, calls, finish = "", "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tcd in d.tool_calls or ():
                if tcd.id is not None:
                    assert tcd.index == len(calls) and tcd.id.startswith("call_")
                    assert tcd.type == "function" and tcd.function.name
                    calls.append([tcd.id, tcd.function.name, tcd.function.arguments or ""])
                else:
                    assert tcd.function.name is None
                    calls[tcd.index][2] += tcd.function.arguments
            finish = ch.finish_reason or finish
    return content, reasoning, [tuple(c) for c in calls], finish


def _validates(call: Any) -> dict[str, Any]:
    assert call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return dict(args)


def test_named_call_validates_and_streams_the_same(tc: openai.OpenAI) -> None:
    whole = _create(tc, tool_choice=NAMED)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _validates(call)
    content, _, calls, finish = _assemble(_create(tc, tool_choice=NAMED, stream=True))
    assert content == "" and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]


CLOSE = "509"
"""The token ``]``: the story model, forced into a JSON array of calls, would go on adding
calls until max_tokens; a logit bias on ``]`` makes it close the array (the grammar allows
``]`` only after a whole call)."""


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate_and_stream_the_same(tc: openai.OpenAI, parallel: bool) -> None:
    bias = {CLOSE: 100} if parallel else None
    whole = _create(tc, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200,
                    logit_bias=bias)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for call in calls:
        _validates(call)
    assert len({c.id for c in calls}) == len(calls)
    content, _, streamed, finish = _assemble(
        _create(tc, tool_choice="required", parallel_tool_calls=parallel, max_tokens=200,
                logit_bias=bias, stream=True))
    assert content == "" and finish == "tool_calls"
    assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments)
                                               for c in calls]


def test_parallel_calls(tc: openai.OpenAI) -> None:
    """A seed (and a milder bias on ``]``) with which the model makes two calls in one
    answer; each validates, and the stream (same seed) carries the same two."""
    body = {"tool_choice": "required", "temperature": 1.0, "seed": 2, "max_tokens": 250,
            "logit_bias": {CLOSE: 16}}
    choice = _create(tc, **body).choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and len(calls) == 2
    for call in calls:
        _validates(call)
    _, _, streamed, _ = _assemble(_create(tc, stream=True, **body))
    assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments)
                                               for c in calls]
    assert len({i for i, _, _ in streamed}) == 2


def test_round_trip_call_result_answer(tc: openai.OpenAI, tool_server: Server) -> None:
    call = _create(tc, tool_choice=NAMED).choices[0].message.tool_calls[0]
    history = [*MESSAGES,
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.function.name,
                                             "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = _create(tc, messages=history, tool_choice="none", max_tokens=12).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the template saw the call (arguments as a mapping) and the tool's result
    with tool_server.http() as c:
        ids = c.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    args = json.loads(call.function.arguments)
    assert f'<tool_call>{json.dumps({"name": "get_weather", "arguments": args})}</tool_call>' \
        in text
    assert "<tool_response>Sunny, 21 C</tool_response>" in text
    assert "- get_weather\n- get_time\n" in text     # the tools, listed by the template


HERMES_REGEX = (r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}'
                r'</tool_call>')
"""Hermes markup the model is made to write (it knows no tools)."""


def test_auto_parses_hermes_markup_whole_and_streamed(tc: openai.OpenAI) -> None:
    body = {"tool_choice": "auto", "extra_body": {"guided_regex": r"Ok\. " + HERMES_REGEX}}
    whole = _create(tc, **body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Ok."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time" and _validates(call)["zone"] in ("UTC", "CET")
    content, _, calls, finish = _assemble(_create(tc, stream=True, **body))
    assert content == "Ok." and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [("get_time", call.function.arguments)]


def test_reasoning_split_whole_and_streamed(tc: openai.OpenAI) -> None:
    body = {"tool_choice": "none", "extra_body": {"guided_regex": "<think>[a-z ]{4,30}"
                                                                  "</think>[a-z ]{4,30}"}}
    msg = _create(tc, **body).choices[0].message
    assert msg.reasoning_content and msg.content
    assert msg.model_extra["reasoning"] == msg.reasoning_content
    assert "think>" not in msg.content + msg.reasoning_content
    content, reasoning, calls, _ = _assemble(_create(tc, stream=True, **body))
    assert (content, reasoning, calls) == (msg.content, msg.reasoning_content, [])


def test_chat_template_kwargs_reach_the_template(tool_server: Server) -> None:
    template = "{{ bos_token }}{{ 'T' if flag else 'F' }}{{ messages[0]['content'] }}"
    with tool_server.http() as c:
        on = c.post("/tokenize", json={"messages": MESSAGES, "chat_template": template,
                                       "chat_template_kwargs": {"flag": True}}).json()
        off = c.post("/tokenize", json={"messages": MESSAGES, "chat_template": template})
        text = [c.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
                for r in (on, off.json())]
    assert [t.replace("<s> ", "<s>") for t in text] == ["<s>TWhat is the weather in Paris?",
                                                        "<s>FWhat is the weather in Paris?"]


@pytest.mark.parametrize("kw, param, words", [
    ({"tools": ["get_weather"]}, "tools", "tools[0] must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools",
     "function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"a": {"$ref": "#/$defs/missing"}}}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": 5}}}],
      "tool_choice": "required"}, "tools", "valid JSON schema"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
])
def test_bad_tools_are_400s_naming_the_parameter(tc: openai.OpenAI, kw: dict[str, Any],
                                                 param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _create(tc, **kw)
    assert err.value.body["param"] == param and words in err.value.body["message"]


def test_auto_needs_the_flags(client: openai.OpenAI) -> None:
    """The session server runs without --enable-auto-tool-choice."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="stories260k", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="auto", max_tokens=4)
    body = err.value.body
    assert body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice --tool-call-parser" in body["message"]
    ok = client.chat.completions.create(model="stories260k", messages=MESSAGES, tools=TOOLS,
                                        tool_choice="none", max_tokens=4, temperature=0)
    assert ok.choices[0].message.tool_calls is None


def test_offline_chat_equals_the_server(tc: openai.OpenAI) -> None:
    from nybble import LLM, SamplingParams
    from nybble.sampling_params import GuidedDecodingParams

    llm = LLM(max_num_seqs=4)
    template = TEMPLATE.read_text()
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    offline = llm.chat(history, SamplingParams(temperature=0, max_tokens=24), tools=TOOLS,
                       chat_template=template, use_tqdm=False)[0]
    online = _create(tc, messages=history, tool_choice="none", max_tokens=24)
    assert offline.outputs[0].text == online.choices[0].message.content
    assert len(offline.prompt_token_ids) == online.usage.prompt_tokens
    named = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=120,
                                              guided_decoding=GuidedDecodingParams(json=WEATHER)),
                     tools=TOOLS, chat_template=template, use_tqdm=False)[0]
    call = _create(tc, tool_choice=NAMED).choices[0].message.tool_calls[0]
    assert named.outputs[0].text == call.function.arguments
