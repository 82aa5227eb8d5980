"""Shared fixtures of the benchmark tests."""
from __future__ import annotations

import pytest

from nybble.config import DEFAULT_MODEL


@pytest.fixture(scope="session")
def tokenizer():  # type: ignore[no-untyped-def]
    """The bundled stories260k tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)
