"""Reasoning parsers (``--reasoning-parser NAME``): split ``<think>...</think>`` from the
answer, as ``reasoning_content``; pure Python, streaming-safe."""
from __future__ import annotations

from nybble.server.reasoning.think import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStreamer,
)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer"]
