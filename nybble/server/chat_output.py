"""A chat sample's text as the answer's parts: reasoning, content and tool calls.

The reasoning parser (``--reasoning-parser``) splits the ``<think>`` part off first; the rest
goes to the tool parser of the request's :class:`ToolPlan` (forced calls never have
reasoning: their grammar starts at the first token). The same parsers serve the whole answer
(:func:`whole_message`) and the stream (:class:`SampleParts`), so the streamed deltas add up
to the whole answer.
"""
from __future__ import annotations

from dataclasses import dataclass

from nybble.server.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStreamer
from nybble.server.responses import AssistantMessage, FunctionCall, ToolCall
from nybble.server.tool_choice import ToolPlan
from nybble.server.tool_parsers import new_call_id
from nybble.server.tool_parsers.streaming import CallDelta, ToolStreamer


def reasoning_parser(name: str | None, plan: ToolPlan) -> ReasoningParser | None:
    """The reasoning parser of a request: ``--reasoning-parser``'s, unless the tool choice
    forces calls (or none is configured)."""
    if name is None or plan.mode in ("named", "required"):
        return None
    return REASONING_PARSERS[name]()


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """``tool_calls`` for a sample that stopped after calling tools, else ``reason``."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def whole_message(text: str, plan: ToolPlan, reasoning: ReasoningParser | None,
                  prefix: str = "") -> AssistantMessage:
    """The assistant message of a whole sample ``text`` (``prefix``: the echoed text that
    leads its content)."""
    thought: str | None = None
    content: str | None = text
    if reasoning is not None:
        thought, content = reasoning.split(text, final=True)
    calls: list[ToolCall] = []
    if plan.parser is not None:
        parsed = plan.parser().parse(content or "", final=True)
        content = parsed.content
        calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name or "",
                                                                  arguments=c.arguments))
                 for c in parsed.calls]
    if prefix:
        content = prefix + (content or "")
    elif content is None and not calls and thought is None:
        content = ""
    return AssistantMessage(content=content, tool_calls=calls or None,
                            reasoning_content=thought, reasoning=thought)


@dataclass
class Parts:
    """What one piece of a sample's text adds: reasoning, content, tool-call deltas."""

    reasoning: str
    content: str
    calls: list[CallDelta]


class SampleParts:
    """One streamed sample's parsers (its text arrives piece by piece).

    Args:
        plan: the request's tool plan.
        reasoning: the reasoning parser, or ``None``.
    """

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.reasoning = ReasoningStreamer(reasoning) if reasoning is not None else None
        self.tools = ToolStreamer(plan.parser()) if plan.parser is not None else None

    @property
    def num_calls(self) -> int:
        """Tool calls streamed so far."""
        return self.tools.num_calls if self.tools is not None else 0

    def push(self, piece: str, final: bool) -> Parts:
        """The new parts after ``piece`` (``final``: the sample's last piece)."""
        thought, content = "", piece
        if self.reasoning is not None:
            thought, content = self.reasoning.push(piece, final)
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.push(content, final)
        return Parts(thought, content, calls)
