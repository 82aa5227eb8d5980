"""Tool calls in a stream: the deltas OpenAI sends, from a parser re-run on the text so far.

Per call, its first delta carries ``index``, ``id``, ``type`` and ``function.name`` (with
``arguments: ""``); later ones carry only ``index`` and an ``arguments`` fragment. Content
before, between or after calls streams as content deltas. The parser's conservative partial
results (:mod:`nybble.server.tool_parsers.base`) make every delta final: nothing sent is
taken back, and the fragments add up to the arguments of the non-streamed parse.

The parser re-reads the whole text for every piece: ``O(length^2)`` over one answer, which
is microseconds per piece for answers of a few thousand characters.
"""
from __future__ import annotations

from dataclasses import dataclass

from nybble.server.tool_parsers.base import ToolParser, new_call_id


@dataclass
class CallDelta:
    """One ``delta.tool_calls`` entry: ``id`` and ``name`` only in a call's first one."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class ToolStreamer:
    """Turns the pieces of one sample's text into content and tool-call deltas.

    Args:
        parser: the format of the calls.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content = ""                 # content sent so far
        self._sent_args: list[int] = []    # per call: argument characters sent
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        """The calls whose first delta went out."""
        return len(self._sent_args)

    def push(self, piece: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """Add ``piece`` (``final``: the sample's last) and return the new content and the
        new call deltas."""
        self.text += piece
        parsed = self.parser.parse(self.text, final)
        content = parsed.content or ""
        new_content = ""
        if content.startswith(self._content):
            new_content = content[len(self._content):]
            self._content = content
        deltas: list[CallDelta] = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self._sent_args):
                self.ids.append(new_call_id())
                self._sent_args.append(0)
                deltas.append(CallDelta(i, "", self.ids[i], call.name))
            sent = self._sent_args[i]
            if len(call.arguments) > sent:
                deltas.append(CallDelta(i, call.arguments[sent:]))
                self._sent_args[i] = len(call.arguments)
        return new_content, deltas
