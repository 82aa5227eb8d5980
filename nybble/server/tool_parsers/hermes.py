"""Hermes / Qwen tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of NousResearch's Hermes 2 Pro function calling, used by the chat templates of
Qwen2.5, Qwen3 and QwQ: each call is one JSON object between the tags; text outside the tags
is content.
"""
from __future__ import annotations

from nybble.server.tool_parsers.base import MalformedCall, ParsedCall, ToolParser, held_back
from nybble.server.tool_parsers.json_scan import check_json, scan_call, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """``--tool-call-parser hermes``."""

    name = "hermes"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See :meth:`ToolParser.split`."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            at = text.find(START, pos)
            if at < 0:
                content.append(text[pos:] if final else held_back(text[pos:], START))
                return "".join(content), calls
            content.append(text[pos:at])
            body = at + len(START)
            end = text.find(END, body)
            stop = len(text) if end < 0 else end
            j = skip_ws(text[:stop], body)
            if j >= stop:
                if final:
                    raise MalformedCall("an empty tool call")
                return "".join(content), calls
            if text[j] != "{":
                if final:
                    raise MalformedCall("a tool call that is not a JSON object")
                return "".join(content), calls
            call, obj_end = scan_call(text[:stop], j, final)
            calls.append(call)
            if final:
                if obj_end is None or text[obj_end:stop].strip():
                    raise MalformedCall("text after the call object")
                check_json(text[j:obj_end])
            if end < 0:
                if not final:
                    call.complete = False   # NOTE: closed only by the end tag
                return "".join(content), calls
            pos = end + len(END)
