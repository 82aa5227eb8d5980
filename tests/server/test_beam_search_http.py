"""``/v1/completions`` with ``use_beam_search``: the ``n`` beams come back best first and equal
transformers' ``generate(num_beams=n, num_return_sequences=n)``; bad combinations are a 400
naming the parameter."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble.config import DEFAULT_MODEL
from nybble.tokenizer.tokenizer import Tokenizer
from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

PROMPT = "Once upon a time"


def test_beams_equal_transformers(server: Server) -> None:
    tok = Tokenizer.from_folder(DEFAULT_MODEL)
    ids = tok.encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3,
                          do_sample=False, length_penalty=0.5, early_stopping=True,
                          max_new_tokens=20, pad_token_id=0)
    with server.http() as c:
        r = c.post("/v1/completions", json={
            "model": "stories260k", "prompt": PROMPT, "max_tokens": 20, "n": 3,
            "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    prefix = tok.decode(ids, skip_special_tokens=True)
    for choice, row in zip(body["choices"], ref[:, len(ids):].tolist()):
        full = tok.decode(ids + row, skip_special_tokens=True)
        assert choice["text"] == full[len(prefix):]
        assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 60
    server.wait_idle()


@pytest.mark.parametrize("extra,param", [
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 0}, "n"),
    ({"use_beam_search": True, "length_penalty": float("inf")}, None),   # not JSON: 400 too
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_beam_requests_are_400s(server: Server, extra: dict, param: str | None) -> None:
    body = {"model": "stories260k", "prompt": PROMPT, "max_tokens": 4, "n": 2, **extra}
    with server.http() as c:
        r = c.post("/v1/completions", json=body) if param is not None else c.post(
            "/v1/completions", content=b'{"prompt": "x", "use_beam_search": true, '
                                       b'"length_penalty": Infinity}',
            headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text
        ok = c.post("/v1/completions", json={**body, **{k: v for k, v in {
            "use_beam_search": True, "n": 2}.items()}, "stream": False, "temperature": 0.0,
            "logprobs": None, "length_penalty": 1.0, "early_stopping": False})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("extra,param", [
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"use_beam_search": True, "stream": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
])
def test_beam_search_on_chat_is_refused_not_ignored(server: Server, extra: dict,
                                                    param: str) -> None:
    """Chat has no beam search: asking for it is a 400, not a greedy answer."""
    body = {"model": "stories260k", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0.0}
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        neutral = c.post("/v1/chat/completions", json={
            **body, "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False})
        assert neutral.status_code == 200, neutral.text
