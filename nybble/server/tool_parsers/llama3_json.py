"""Llama 3.1 JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``
(optionally after ``<|python_tag|>``; several calls separated by ``;``).

Meta's Llama 3.1 model card ("JSON based tool calling"): a call is a message that is one JSON
object; any other message is content.
"""
from __future__ import annotations

from nybble.server.tool_parsers.base import MalformedCall, ParsedCall, ToolParser
from nybble.server.tool_parsers.json_scan import check_json, scan_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``--tool-call-parser llama3_json``."""

    name = "llama3_json"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See :meth:`ToolParser.split`."""
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
            if start >= len(text) and not final:
                return "", []           # NOTE: the tag, and the calls still to come
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return "", []               # NOTE: nothing but (the start of) the tag yet
        if start >= len(text) or text[start] != "{":
            return text, []             # NOTE: a plain answer: all content
        calls: list[ParsedCall] = []
        j = start
        while True:
            call, end = scan_call(text, j, final)
            calls.append(call)
            if end is None:
                return "", calls
            if final:
                check_json(text[j:end])
            j = skip_ws(text, end)
            if j >= len(text):
                return "", calls
            if text[j] != ";":
                if final:
                    raise MalformedCall("expected ';' between calls")
                return "", calls
            j = skip_ws(text, j + 1)
            if j >= len(text):
                if final:
                    raise MalformedCall("a ';' with no call after it")
                return "", calls
            if text[j] != "{":
                if final:
                    raise MalformedCall("expected a call object after ';'")
                return "", calls
