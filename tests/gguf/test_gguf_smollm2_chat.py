"""``nybble serve`` on the published SmolLM2-135M-Instruct Q4_1 GGUF answers the reference
questions through the openai client exactly as transformers does in float32 on the
dequantized weights (``reference/transformers_fp32_chat.json``) on the exact CPU path
(``--cpu-activation-dtype float32``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import shared_path
from tests.server.conftest import API_KEY, Server, start_server, stop_server

MODEL = shared_path("models", "smollm2-135m-instruct")
FILE = os.path.join(MODEL, "SmolLM2-135M-Instruct.Q4_1.gguf")

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_chat_reproduces_transformers(tmp_path: Path) -> None:
    with open(os.path.join(MODEL, "reference", "transformers_fp32_chat.json"),
              encoding="utf-8") as f:
        refs = json.load(f)
    proc, url = start_server(tmp_path / "serve.log", FILE, "--api-key", API_KEY,
                             "--max-model-len", "512", "--dtype", "float32",
                             "--cpu-activation-dtype", "float32",
                             env={"NYBBLE_CACHE_DIR": str(tmp_path / "cache")})
    try:
        client = Server(url=url, api_key=API_KEY, log_path=tmp_path / "serve.log").openai()
        for ref in refs:
            r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                               messages=ref["messages"],
                                               max_tokens=ref["max_tokens"], temperature=0)
            assert r.choices[0].message.content == ref["content"]
            assert r.usage.prompt_tokens == ref["prompt_tokens"]
            assert r.usage.completion_tokens == len(ref["completion_token_ids"])
    finally:
        stop_server(proc)
