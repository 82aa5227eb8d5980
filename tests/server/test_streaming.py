"""Continuous batching through the API: 32 concurrent streams equal the offline ``LLM``."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from nybble import LLM, SamplingParams

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

SUBJECTS = ["Lily", "Tom", "a little dog", "the old man", "a red bird", "Sue and Ben",
            "the big cat", "a small boat"]
PLACES = ["in the park", "at home", "by the sea", "in the forest"]


def make_prompts() -> list[tuple[str, int]]:
    """32 different prompts, each with its own output length (tokens)."""
    prompts = [f"One day, {s} was {p}." for s in SUBJECTS for p in PLACES]
    return [(p, 4 + 5 * (i % 11)) for i, p in enumerate(prompts)]


async def stream_all(server: Server, prompts: list[tuple[str, int]]) -> list[str]:
    client = server.async_openai()

    async def one(prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(model="stories260k", prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0.0,
                                                 stream=True)
        parts = []
        async for chunk in stream:
            parts.extend(c.text for c in chunk.choices)
        return "".join(parts)

    try:
        return list(await asyncio.gather(*(one(p, m) for p, m in prompts)))
    finally:
        await client.close()


def test_32_concurrent_streams_match_offline_llm(server: Server) -> None:
    prompts = make_prompts()
    assert len(prompts) == 32
    server.wait_idle()
    texts = asyncio.run(stream_all(server, prompts))
    llm = LLM()
    expected = [o.outputs[0].text for o in llm.generate(
        [p for p, _ in prompts],
        [SamplingParams(temperature=0.0, max_tokens=m) for _, m in prompts], use_tqdm=False)]
    assert texts == expected
    stats = server.wait_idle()
    assert stats["peak_num_seqs_in_step"] > 1
    assert stats["num_free_blocks"] == stats["num_blocks"]
