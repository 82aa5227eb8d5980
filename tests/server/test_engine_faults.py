"""Fault injection into the engine-core process of a real ``nybble serve``
(``NYBBLE_TEST_FAULTS``, see :mod:`nybble.runtime.engine.fault_injection`): a model forward that
raises, an admission that fails late and a sampler that raises mid-stream each fail only
their request (500 ``internal_error``, or an error event that ends the stream); the server
stays healthy, frees every block and answers the next request with the same greedy text as
a fresh server."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

BODY = {"model": "stories260k", "prompt": "The dog", "max_tokens": 8, "temperature": 0.0}


def _complete(c: httpx.Client, **extra: object) -> httpx.Response:
    return c.post("/v1/completions", json={**BODY, **extra})


def test_faults_fail_only_their_request_and_the_engine_keeps_serving(
        server: Server, tmp_path: Path) -> None:
    with server.http() as c:
        fresh = _complete(c).json()["choices"][0]["text"]
    # call counts: forward 1 is A's prefill; add 2 is B's admission; sampler 1..2 are C's
    # prefill and first decode, sampler 3 its second decode
    log = tmp_path / "serve.log"
    proc, url = start_server(log, env={"NYBBLE_TEST_FAULTS": "forward@1,add@2,sampler@3"})
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for name in ("A", "B"):
                r = _complete(c)
                assert r.status_code == 500, (name, r.text)
                error = r.json()["error"]
                # NOTE: a short message; the exception text stays in the server log
                assert error["type"] == "internal_error"
                assert error["message"].startswith("the engine failed this request")
            with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "choices" in chunks[0]               # C streamed tokens before the fault
            assert chunks[-1]["error"]["type"] == "internal_error"
            assert chunks[-1]["error"]["message"].startswith("the engine failed this request")
            assert c.get("/health").status_code == 200
            for _ in range(2):
                r = _complete(c)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == fresh
            stats = c.get("/internal/stats").json()
            assert stats["num_running"] == stats["num_waiting"] == 0
            assert stats["num_free_blocks"] == stats["num_blocks"]
            assert stats["num_live_tokens"] == 0
    finally:
        stop_server(proc)
    text = log.read_text()
    assert "test fault injection is on" in text
    assert text.count("engine step failed") >= 2 and "add_request(" in text
    assert "injected sampler failure" in text and "injected forward failure" in text


def test_three_failed_steps_in_a_row_turn_the_server_unhealthy(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc, url = start_server(log, env={"NYBBLE_TEST_FAULTS": "forward@1,forward@2,forward@3"})
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for _ in range(3):
                r = _complete(c)
                assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
            deadline = time.monotonic() + 10   # NOTE: the fatal message follows the 500
            while c.get("/health").status_code != 503:
                assert time.monotonic() < deadline, "still healthy after 3 failed steps"
                time.sleep(0.05)
            r = _complete(c)
            assert r.status_code == 503 and "can no longer step" in r.json()["error"]["message"]
    finally:
        stop_server(proc)
    assert "3 engine steps failed in a row" in log.read_text()
