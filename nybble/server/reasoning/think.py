"""``<think>...</think>`` reasoning, split from the answer (vLLM's reasoning parsers).

- ``deepseek_r1``: DeepSeek-R1 style: everything before ``</think>`` is reasoning, whether the
  output opens with ``<think>`` or the chat template already put it in the prompt; an output
  with no ``</think>`` is all reasoning (cut short while thinking).
- ``qwen3``: Qwen3 style: reasoning only when the output opens with ``<think>`` (Qwen3 with
  thinking on); otherwise all of it is content (``chat_template_kwargs: {"enable_thinking":
  false}`` makes the template close an empty think block in the prompt). Models whose
  template opens the block in the prompt (Qwen3 "Thinking-2507") take ``deepseek_r1``.

Like the tool parsers, :meth:`ReasoningParser.split` is called on the whole text so far and
is conservative while it is partial (a tag that may be arriving is held back), so streamed
``reasoning_content`` and ``content`` add up to the non-streamed split.
"""
from __future__ import annotations

from typing import ClassVar

START, END = "<think>", "</think>"


def _held(segment: str, tag: str) -> str:
    for k in range(min(len(tag) - 1, len(segment)), 0, -1):
        if segment.endswith(tag[:k]):
            return segment[:-k]
    return segment


class ReasoningParser:
    """``--reasoning-parser deepseek_r1``: reasoning up to ``</think>`` (opening tag
    optional).

    Attributes:
        needs_start: reasoning only if the output opens with ``<think>`` (``qwen3``).
    """

    name: ClassVar[str] = "deepseek_r1"
    needs_start: ClassVar[bool] = False

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of ``text``; ``None``: there is none (yet).

        Partial (``final=False``): text that may be the start of a tag is in neither.
        """
        body = text.lstrip()
        if body.startswith(START):
            body = body[len(START):]
        elif not final and START.startswith(body):
            return None, None          # NOTE: maybe the opening tag, still arriving
        elif self.needs_start:
            return None, text
        end = body.find(END)
        if end < 0:
            return (body if final else _held(body, END)) or None, None
        return body[:end] or None, body[end + len(END):] or None


class Qwen3ReasoningParser(ReasoningParser):
    """``--reasoning-parser qwen3``: reasoning only when the output opens with
    ``<think>``."""

    name = "qwen3"
    needs_start = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ReasoningParser, Qwen3ReasoningParser)}
"""The parsers ``--reasoning-parser`` accepts, by name."""


class ReasoningStreamer:
    """Turns the pieces of one sample's text into reasoning and content deltas.

    Args:
        parser: the reasoning format.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = ["", ""]

    def push(self, piece: str, final: bool = False) -> tuple[str, str]:
        """Add ``piece`` (``final``: the sample's last); the new ``(reasoning, content)``
        text."""
        self.text += piece
        new = []
        for k, part in enumerate(self.parser.split(self.text, final)):
            part = part or ""
            if part.startswith(self._sent[k]):
                new.append(part[len(self._sent[k]):])
                self._sent[k] = part
            else:
                new.append("")
        return new[0], new[1]
