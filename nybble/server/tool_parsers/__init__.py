"""Tool-call parsers (``--tool-call-parser NAME``): pure Python, streaming-safe.

``hermes`` (Qwen, Hermes ``<tool_call>``), ``llama3_json``, ``mistral`` (``[TOOL_CALLS]``),
``pythonic`` (``[f(a=1)]``); and the two forced shapes of the structured-output path
(:mod:`nybble.server.tool_parsers.forced`).
"""
from __future__ import annotations

from nybble.server.tool_parsers.base import Parse, ParsedCall, ToolParser, new_call_id
from nybble.server.tool_parsers.hermes import HermesToolParser
from nybble.server.tool_parsers.llama3_json import Llama3JsonToolParser
from nybble.server.tool_parsers.mistral import MistralToolParser
from nybble.server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        PythonicToolParser)}
"""The parsers ``--tool-call-parser`` accepts, by name."""

__all__ = ["TOOL_PARSERS", "Parse", "ParsedCall", "ToolParser", "new_call_id"]
