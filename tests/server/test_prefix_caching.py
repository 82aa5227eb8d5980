"""Prefix caching in ``nybble serve`` (on by default): a request sharing a long prefix with an
earlier one is served partly from cached KV blocks (``nybble:prefix_cache_hits_total`` rises),
with unchanged output; ``--no-enable-prefix-caching`` turns it off."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nybble import LLM, SamplingParams

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

PREFIX = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
          "the park with her mom. One day, she saw a big red ball under a tree.")


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def test_prefix_hits_counted_and_output_unchanged(tmp_path) -> None:
    prompts = [PREFIX + " She", PREFIX + " Tom"]
    want = [o.outputs[0].text for o in LLM().generate(
        prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    proc, url = start_server(tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        got = []
        for p in prompts:
            before = _counter(url, "nybble:prefix_cache_hits_total")
            got.append(client.completions.create(model="stories260k", prompt=p, max_tokens=16,
                                                 temperature=0).choices[0].text)
        assert got == want
        hits = _counter(url, "nybble:prefix_cache_hits_total")
        queries = _counter(url, "nybble:prefix_cache_queries_total")
        assert hits - before >= 32  # the second prompt found at least two full 16-token blocks
        assert queries > hits
    finally:
        stop_server(proc)


def test_no_enable_prefix_caching_turns_it_off(tmp_path) -> None:
    proc, url = start_server(tmp_path / "serve.log", "--no-enable-prefix-caching")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for _ in range(2):
            client.completions.create(model="stories260k", prompt=PREFIX, max_tokens=4)
        assert _counter(url, "nybble:prefix_cache_hits_total") == 0
    finally:
        stop_server(proc)
