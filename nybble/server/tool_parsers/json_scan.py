"""Scanning JSON that may be cut short (a model's output so far): where a value ends, and
the ``name`` and arguments of a call object ``{"name": ..., "arguments": {...}}``.

Not a validator: the scanner only finds boundaries (strings, escapes, nesting), so that a
call's arguments can be streamed as the exact text the model wrote; the final text is
checked by ``json.loads`` (:func:`check_json`).
"""
from __future__ import annotations

import json
from typing import Any

from nybble.server.tool_parsers.base import MalformedCall, ParsedCall

WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")
"""The keys that hold a call's arguments (Hermes and Mistral: ``arguments``; Llama 3:
``parameters``)."""


def skip_ws(text: str, i: int) -> int:
    """The first index ``>= i`` that is not JSON whitespace (``len(text)`` if none)."""
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the string starting at ``text[i] == '"'``, or ``None``."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at ``text[i]``, or ``None`` when the
    text ends first (a number or literal at the very end is not known to be whole)."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        return _string_end(text, i)
    if first in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\n\r":
        j += 1
    return j if j < len(text) else None


def check_json(raw: str) -> Any:
    """``json.loads(raw)``.

    Raises:
        MalformedCall: ``raw`` is not JSON.
    """
    try:
        return json.loads(raw)
    except ValueError as e:
        raise MalformedCall(f"not JSON: {e}") from None


def scan_call(text: str, i: int, final: bool) -> tuple[ParsedCall, int | None]:
    """The call object starting at ``text[i] == '{'`` and its end (exclusive; ``None`` while
    it is open).

    ``arguments`` is the exact text of the arguments value (``"{}"`` for a closed object
    without one; a JSON string value counts once whole, decoded); while the value is open,
    the text so far less trailing whitespace.

    Raises:
        MalformedCall: ``final`` and the object is not a call (bad syntax, a name that is not
            a string, or unclosed).
    """
    call = ParsedCall(None, "", False)
    seen_args = False
    j = skip_ws(text, i + 1)
    while True:
        if j >= len(text):
            break
        if text[j] == "}":
            call.complete = True
            if not seen_args:
                call.arguments = "{}"
            return call, j + 1
        if text[j] != '"':
            return _bad(call, final, "expected a key")
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = check_json(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            return _bad(call, final, "expected ':'")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        if key == "name":
            if end is None:
                break
            name = check_json(text[j:end]) if final else _loads_or_none(text[j:end])
            if not isinstance(name, str):
                return _bad(call, final, "the name is not a string")
            call.name = name
        elif key in ARGUMENT_KEYS and not seen_args:
            if end is None:
                if text[j] != '"':
                    call.arguments = text[j:].rstrip()
                break
            raw = text[j:end]
            value = _loads_or_none(raw)
            call.arguments = value if isinstance(value, str) else raw
            seen_args = True
        elif end is None:
            break
        j = skip_ws(text, end)
        if j >= len(text):
            break
        if text[j] == ",":
            j = skip_ws(text, j + 1)
        elif text[j] != "}":
            return _bad(call, final, "expected ',' or '}'")
    if final:
        raise MalformedCall("the call object is not closed")
    return call, None


def scan_call_array(text: str, i: int, final: bool) -> tuple[list[ParsedCall], int | None]:
    """The call objects of the JSON array starting at ``text[i] == '['`` and its end
    (``None`` while open; partial: the calls so far, the last maybe open).

    Raises:
        MalformedCall: ``final`` and the array is not a closed array of call objects.
    """
    calls: list[ParsedCall] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "]":
            return calls, j + 1
        if text[j] != "{":
            if final:
                raise MalformedCall("expected a call object")
            return calls, None
        call, end = scan_call(text, j, final)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "]":
            if final:
                raise MalformedCall("expected ',' or ']'")
            return calls, None
    if final:
        raise MalformedCall("the array is not closed")
    return calls, None


def _loads_or_none(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _bad(call: ParsedCall, final: bool, why: str) -> tuple[ParsedCall, int | None]:
    if final:
        raise MalformedCall(why)
    return call, None
