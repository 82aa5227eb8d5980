"""Pythonic tool calls: the answer is a Python list of calls, ``[f(a=1), g(b="x")]``.

The format of Llama 3.2 and Llama 4's "pythonic" tool calling (Meta's model cards; Llama 4
may wrap it in ``<|python_start|>`` ... ``<|python_end|>``): keyword arguments whose values
are Python literals; a call's arguments are those keywords as a JSON object
(``json.dumps``), so each call's arguments stream as one fragment, once its ``)`` closes it.
"""
from __future__ import annotations

import ast
import json
import re

from nybble.server.tool_parsers.base import MalformedCall, ParsedCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\(")


def _call(source: str) -> ParsedCall:
    """One whole ``name(k=v, ...)`` element as a complete call.

    Raises:
        MalformedCall: not a call with literal keyword arguments.
    """
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as e:
        raise MalformedCall(f"not a Python call: {e}") from None
    if not isinstance(node, ast.Call) or node.args:
        raise MalformedCall("expected name(keyword=value, ...)")
    name = ast.unparse(node.func)
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except ValueError as e:
        raise MalformedCall(f"an argument is not a literal: {e}") from None
    if None in args:
        raise MalformedCall("**kwargs is not a tool call")
    return ParsedCall(name, json.dumps(args, ensure_ascii=False), True)


def _elements(text: str, i: int) -> tuple[list[tuple[int, int]], int | None]:
    """The ``(start, end)`` spans of the top-level elements of the list opening at
    ``text[i] == '['``, and the list's end (``None`` while open; the last open element is
    then not listed)."""
    spans: list[tuple[int, int]] = []
    depth, quote, start, j = 0, "", i + 1, i + 1
    while j < len(text):
        ch = text[j]
        if quote:
            if ch == "\\":
                j += 1
            elif text.startswith(quote, j):
                j += len(quote) - 1
                quote = ""
        elif ch in "\"'":
            quote = ch * 3 if text.startswith(ch * 3, j) else ch
            j += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                if text[start:j].strip():
                    spans.append((start, j))
                return spans, j + 1
            depth -= 1
        elif ch == "," and depth == 0:
            spans.append((start, j))
            start = j + 1
        j += 1
    return spans, None


class PythonicToolParser(ToolParser):
    """``--tool-call-parser pythonic``."""

    name = "pythonic"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See :meth:`ToolParser.split`."""
        body = text.strip()
        if body.startswith(START):
            body = body[len(START):]
            body = body[:-len(END)] if body.endswith(END) else body
            body = body.strip()
            if not body and not final:
                return "", []
        elif not final and START.startswith(body):
            return "", []
        if not body.startswith("["):
            return text, []
        spans, end = _elements(body, 0)
        if final:
            if end is None or body[end:].strip():
                raise MalformedCall("not one closed list of calls")
            return "", [_call(body[s:e]) for s, e in spans]
        calls: list[ParsedCall] = []
        for s, e in spans:
            try:
                calls.append(_call(body[s:e]))
            except MalformedCall:
                return "", calls
        if end is None:
            opening = _NAME.match(body, spans[-1][1] + 1 if spans else 1)
            if opening:
                calls.append(ParsedCall(opening.group(1), "", False))
        return "", calls
