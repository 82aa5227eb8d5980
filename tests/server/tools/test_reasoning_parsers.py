"""The reasoning parsers on canonical outputs, whole and cut at every character boundary."""
from __future__ import annotations

import pytest

from nybble.server.reasoning import REASONING_PARSERS, ReasoningStreamer

CASES = [
    ("deepseek_r1", "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
     "\nLet me think.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "Template opened it. 2+2=4.</think>4", "Template opened it. 2+2=4.", "4"),
    ("deepseek_r1", "<think>cut short while thin", "cut short while thin", None),
    ("qwen3", "<think>\nhmm <b> a < c\n</think>\n\nDone.", "\nhmm <b> a < c\n", "\n\nDone."),
    ("qwen3", "No thinking here, </think> is just text.", None,
     "No thinking here, </think> is just text."),
    ("qwen3", "<thin is not the tag", None, "<thin is not the tag"),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_split_whole_and_streamed(name: str, text: str, reasoning: str | None,
                                  content: str | None) -> None:
    parser = REASONING_PARSERS[name]()
    assert parser.split(text, final=True) == (reasoning, content)
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text) + [""]]:
        streamer = ReasoningStreamer(REASONING_PARSERS[name]())
        got = ["", ""]
        for k, piece in enumerate(pieces):
            r, c = streamer.push(piece, final=k == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert got == [reasoning or "", content or ""], pieces
        if reasoning is not None:
            assert "<think>" not in got[1] and "</think>" not in got[0]
