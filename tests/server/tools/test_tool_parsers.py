"""The tool-call parsers on canonical outputs of each format, whole and streamed: cut at
every character boundary (and one character at a time), the streamed deltas must add up to
exactly the whole parse, and no markup may reach the content."""
from __future__ import annotations

import json

import pytest

from nybble.server.tool_parsers import TOOL_PARSERS, ToolParser
from nybble.server.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from nybble.server.tool_parsers.streaming import ToolStreamer

WEATHER = {"city": "Paris", "unit": "celsius"}

# (parser, model output, expected content, expected [(name, arguments dict)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a \\"quoted\\" } brace"}, "name": "search"}'
               '\n</tool_call>', None, [("search", {"q": 'a "quoted" } brace'})]),
    ("hermes", "No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 "
               "and <tool is not a tag.", []),
    ("hermes", '<tool_call>\n{"name": "broken", "arguments": {"x": }\n</tool_call>',
     '<tool_call>\n{"name": "broken", "arguments": {"x": }\n</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"unit": "celsius"}}; {"name": "noop", "parameters": {}}', None,
     [("get_weather", WEATHER), ("noop", {})]),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}, {"name": "noop", "arguments": {}}]', None,
     [("get_weather", WEATHER), ("noop", {})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}]', "Sure.", [("get_weather", WEATHER)]),
    ("mistral", "Just [TOOL] text", "Just [TOOL] text", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), noop()]', None,
     [("get_weather", WEATHER), ("noop", {})]),
    ("pythonic", '<|python_start|>[search(q="a, b) [c]", n=3)]<|python_end|>', None,
     [("search", {"q": "a, b) [c]", "n": 3})]),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
]


def _parser(name: str) -> ToolParser:
    return TOOL_PARSERS[name]()


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    """Stream ``pieces``; the assembled content, (name, arguments) per call, and how many
    calls' first deltas carried an id."""
    streamer = ToolStreamer(parser)
    content, calls, ids = "", [], 0
    for k, piece in enumerate(pieces):
        new, deltas = streamer.push(piece, final=k == len(pieces) - 1)
        content += new
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.id.startswith("call_") and d.name
                calls.append([d.name, ""])
                ids += 1
            else:
                assert d.name is None and d.index < len(calls)
            calls[d.index][1] += d.arguments
    return content, [(n, a) for n, a in calls], ids


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_whole_output(name: str, text: str, content: str | None,
                      expected: list[tuple[str, dict]]) -> None:
    parsed = _parser(name).parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == expected


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_streamed_at_every_cut(name: str, text: str, content: str | None,
                               expected: list[tuple[str, dict]]) -> None:
    parsed = _parser(name).parse(text, final=True)
    whole = [(c.name, c.arguments) for c in parsed.calls]
    markup = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>",
              "<|python_start|>")
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text) + [""]]
    for pieces in splits:
        got_content, calls, ids = _stream(_parser(name), pieces)
        assert got_content == (parsed.content or ""), pieces
        if "broken" in text:
            continue   # NOTE: a call header that went out cannot be taken back (documented)
        assert calls == whole, pieces
        assert ids == len(whole)
        if whole:
            assert not any(m in got_content for m in markup)


def test_partial_content_never_shows_a_tag_that_may_be_arriving() -> None:
    parser = _parser("hermes")
    assert parser.parse("Hi <tool_", final=False).content == "Hi"
    assert parser.parse("Hi <tool_", final=True).content == "Hi <tool_"
    assert _parser("mistral").parse("ok [TOOL_CA", final=False).content == "ok"


def test_named_and_required_shapes() -> None:
    args = '{"city":"Paris","unit":"celsius"}'
    named = NamedCallParser("get_weather").parse(args, final=True)
    assert named.content is None
    assert [(c.name, c.arguments) for c in named.calls] == [("get_weather", args)]
    text = '[{"name":"get_weather","parameters":' + args + '},{"name":"noop","parameters":{}}]'
    req = RequiredCallsParser().parse(text, final=True)
    assert [(c.name, c.arguments) for c in req.calls] == [("get_weather", args), ("noop", "{}")]
    for k in range(len(text) + 1):
        assert _stream(RequiredCallsParser(), [text[:k], text[k:]])[1] == \
            [("get_weather", args), ("noop", "{}")]
    # cut short by max_tokens: no call, the text is content
    cut = NamedCallParser("get_weather").parse(args[:-3], final=True)
    assert cut.calls == [] and cut.content == args[:-3]
