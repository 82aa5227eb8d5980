"""The outputs of forced tool choice, generated under a grammar (the structured-output path).

- a named function (``tool_choice: {"type": "function", ...}``): the output is that
  function's arguments object, and nothing else;
- ``required``: the output is a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` of
  at least one call (one, unless ``parallel_tool_calls``), as vLLM generates it.

The grammar guarantees the shape, so these parsers never see markup to hold back.
"""
from __future__ import annotations

from nybble.server.tool_parsers.base import MalformedCall, ParsedCall, ToolParser
from nybble.server.tool_parsers.json_scan import check_json, scan_call_array, skip_ws


class NamedCallParser(ToolParser):
    """The output is the arguments of one call of ``function_name``."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See :meth:`ToolParser.split`."""
        if final:
            check_json(text)
            return "", [ParsedCall(self.function_name, text, True)]
        return "", [ParsedCall(self.function_name, text.rstrip(), False)]


class RequiredCallsParser(ToolParser):
    """The output is a JSON array of calls (``tool_choice: "required"``)."""

    name = "required"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See :meth:`ToolParser.split`."""
        j = skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            if final:
                raise MalformedCall("expected a JSON array of calls")
            return "", []
        calls, end = scan_call_array(text, j, final)
        if final:
            assert end is not None
            check_json(text[j:end])
        return "", calls
