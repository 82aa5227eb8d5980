"""What every tool-call parser returns, and the rules they share.

A parser reads a model's output text and splits it into plain content and the tool calls its
markup holds. It is called on the whole text seen so far, again after every new piece
(:class:`nybble.server.tool_parsers.streaming.ToolStreamer`), so it must be *conservative*
while the text is partial (``final=False``): the content it returns never includes text that
could still turn out to be markup, and a call's ``arguments`` is always a prefix of the
arguments the whole text will give. That is what makes streaming safe: a client never sees
markup in ``content``, and the streamed argument fragments add up to exactly the
non-streamed call's arguments.

Content rules (the same for every format, :meth:`ToolParser.parse`): the content is the text
outside the markup, concatenated; while partial its trailing whitespace is held back (it may
precede markup); in the final result, with calls it is right-stripped (``None`` when
nothing is left, as OpenAI sends), without calls it is the whole text. A final text whose
markup does not parse (bad JSON, an unterminated call) has no calls: all of it is content.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


class MalformedCall(ValueError):
    """The (final) text has tool-call markup that does not parse."""


@dataclass
class ParsedCall:
    """One tool call as far as the text shows it.

    Attributes:
        name: the function's name, ``None`` until its whole string is known.
        arguments: the arguments JSON text known so far (a prefix of the final one; the
            exact text the model wrote for the arguments object).
        complete: the call's markup is closed (its arguments are final).
    """

    name: str | None
    arguments: str
    complete: bool


@dataclass
class Parse:
    """A parser's result: ``content`` (``None``: none) and the ``calls``."""

    content: str | None
    calls: list[ParsedCall]


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` and 24 hex digits (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(segment: str, tag: str) -> str:
    """``segment`` without a suffix that is a proper prefix of ``tag`` (a tag that may be
    arriving): what can be shown of content that markup may follow."""
    for k in range(min(len(tag) - 1, len(segment)), 0, -1):
        if segment.endswith(tag[:k]):
            return segment[:-k]
    return segment


class ToolParser(ABC):
    """A tool-call format (``--tool-call-parser NAME``).

    Attributes:
        name: the flag's value.
        keeps_special_tokens: the markup is made of special tokens (``[TOOL_CALLS]``,
            ``<|python_tag|>``): requests are decoded with ``skip_special_tokens`` off.
    """

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The raw content (text outside markup, concatenated) and the calls of ``text``.

        Partial (``final=False``): conservative (see the module's docstring), never raises.

        Raises:
            MalformedCall: ``final`` and the markup does not parse.
        """

    def parse(self, text: str, final: bool) -> Parse:
        """``text`` split into content and calls by the shared content rules (module
        docstring). Never raises: malformed final markup is content."""
        if not final:
            content, calls = self.split(text, False)
            return Parse(content.rstrip(), calls)
        try:
            content, calls = self.split(text, True)
        except MalformedCall:
            return Parse(text, [])
        if any(c.name is None or not c.complete for c in calls):
            return Parse(text, [])
        if not calls:
            return Parse(text, [])
        return Parse(content.rstrip() or None, calls)
