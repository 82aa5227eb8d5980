"""Mistral tool calls: ``[TOOL_CALLS]`` and a JSON array ``[{"name": ..., "arguments": {...}},
...]``.

The format of Mistral's v3 tokenizer (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct,
Mistral Nemo): the special token ``[TOOL_CALLS]`` starts the calls; the text before it is
content.
"""
from __future__ import annotations

from nybble.server.tool_parsers.base import MalformedCall, ParsedCall, ToolParser, held_back
from nybble.server.tool_parsers.json_scan import check_json, scan_call_array, skip_ws

TAG = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """``--tool-call-parser mistral``."""

    name = "mistral"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See :meth:`ToolParser.split`."""
        at = text.find(TAG)
        if at < 0:
            return (text if final else held_back(text, TAG)), []
        j = skip_ws(text, at + len(TAG))
        if j >= len(text):
            if final:
                raise MalformedCall(f"nothing after {TAG}")
            return text[:at], []
        if text[j] != "[":
            if final:
                raise MalformedCall(f"{TAG} not followed by a JSON array")
            return text[:at], []
        calls, end = scan_call_array(text, j, final)
        if final:
            assert end is not None
            if text[end:].strip():
                raise MalformedCall("text after the calls")
            check_json(text[j:end])
        return text[:at], calls
