"""``--generation-config``: the model folder's generation config as request defaults."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nybble.server.generation_defaults import generation_defaults
from nybble.server.protocol import ChatCompletionRequest
from nybble.server.serving import sampling_params


def test_defaults_from_the_folder_and_off(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7,
         "do_sample": True, "eos_token_id": 2}))
    assert generation_defaults("auto", str(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults(str(tmp_path), "/nonexistent")["top_k"] == 20
    with pytest.raises(ValueError, match="auto, vllm or a folder"):
        generation_defaults("sometimes", str(tmp_path))


def test_auto_on_a_model_file_has_no_defaults(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"   # nybble serve model.gguf: no folder to read
    gguf.write_bytes(b"GGUF")
    assert generation_defaults("auto", str(gguf)) == {}


def test_a_request_value_wins_over_a_default() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], "top_p": 0.5})
    p = sampling_params(req, None, None, defaults={"temperature": 0.6, "top_p": 0.9,
                                                   "max_tokens": 7})
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k) == (0.6, 0.5, 7, -1)
    plain = sampling_params(req, None, None)
    assert (plain.temperature, plain.top_p, plain.max_tokens) == (1.0, 0.5, None)
