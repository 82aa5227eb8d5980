"""Resource limits, on a server started with small ones: body size (413), prompts x n (400),
admission control (503 with Retry-After), idle connections and requests that never arrive
whole closed, a client that leaves
before its request's first step, and a chat template that raises (400, not 500)."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nybble.config import DEFAULT_MODEL
from tests.server.conftest import Server, start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

BODY_LIMIT = 4096
KEEP_ALIVE_S = 1.0
REQUEST_READ_S = 1.5
TEMPLATE = (
    "{%- if messages | length > 1 and messages[0]['role'] == messages[1]['role'] -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{%- endif -%}"
    "{%- if messages[0]['content'] == 'divide' -%}{{ 1 // 0 }}{%- endif -%}"
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server (no API key) on a copy of the bundled model whose chat template raises, with
    small limits: 4 sequences per step, 4 waiting requests, 8 sequences per request."""
    root = tmp_path_factory.mktemp("limited")
    model = root / "stories260k"
    shutil.copytree(DEFAULT_MODEL, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    proc, url = start_server(root / "serve.log", str(model), "--max-num-seqs", "4",
                             "--max-num-waiting-requests", "4", "--max-seqs-per-request", "8",
                             "--max-request-body-bytes", str(BODY_LIMIT),
                             "--timeout-keep-alive", str(KEEP_ALIVE_S),
                             "--timeout-request-read", str(REQUEST_READ_S))
    try:
        yield Server(url=url, api_key="", log_path=root / "serve.log", pid=proc.pid)
    finally:
        stop_server(proc)


def _error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_body_over_the_limit_is_413(limited: Server) -> None:
    big = {"prompt": "a " * BODY_LIMIT, "max_tokens": 2}
    with httpx.Client(base_url=limited.url) as c:
        error = _error(c.post("/v1/completions", json=big), 413)
        assert f"at most {BODY_LIMIT} bytes" in str(error["message"])

        def chunks() -> Iterator[bytes]:      # no Content-Length: counted as it arrives
            body = json.dumps(big).encode()
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        _error(c.post("/v1/completions", content=chunks(),
                      headers={"Content-Type": "application/json"}), 413)
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code \
            == 200


def test_prompts_times_n_over_the_cap_is_400(limited: Server) -> None:
    with httpx.Client(base_url=limited.url) as c:
        error = _error(c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3,
                                                       "max_tokens": 2}), 400)
        assert error["param"] == "prompt" and "3 prompts x n 3 = 9" in str(error["message"])
        assert c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 4,
                                               "max_tokens": 2}).status_code == 200


def test_admission_control_answers_503_with_retry_after(limited: Server) -> None:
    # NOTE: long enough that the burst arrives while the first requests still run
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=120) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=body)
                                               for _ in range(24))))

    answers = asyncio.run(burst())
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= 4                       # at least the 4 that may wait
    for r in answers:
        if r.status_code == 503:
            error = _error(r, 503)
            assert error["type"] == "service_unavailable" and int(r.headers["Retry-After"]) >= 1
            assert "max_num_waiting_requests 4" in str(error["message"])
        else:
            assert r.json()["usage"]["completion_tokens"] == 400


def test_idle_connection_is_closed(limited: Server) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as idle:
        idle.settimeout(10 * KEEP_ALIVE_S + 10)
        t0 = time.monotonic()
        assert idle.recv(1) == b""                       # closed by the server, no request
        assert time.monotonic() - t0 < 10 * KEEP_ALIVE_S + 5


@pytest.mark.parametrize("part", [
    b"P",                                                                   # one byte
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",                    # no blank line
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{\"prompt\": ",                         # short body
], ids=["one-byte", "partial-headers", "partial-body"])
def test_a_request_that_never_arrives_whole_is_closed(limited: Server, part: bytes) -> None:
    """A client that sends part of a request and then nothing, or drips it a byte at a time,
    loses its connection --timeout-request-read seconds after the first byte (slowloris);
    the server serves others meanwhile and after."""
    host, port = limited.url.removeprefix("http://").split(":")
    bound = 10 * REQUEST_READ_S + 5
    with socket.create_connection((host, int(port))) as slow:
        slow.settimeout(bound)
        t0 = time.monotonic()
        slow.sendall(part)
        with httpx.Client(base_url=limited.url, timeout=30) as c:   # others are served
            assert c.get("/health").status_code == 200
        try:
            while time.monotonic() - t0 < bound:   # drip: each byte must not extend the time
                slow.sendall(b" ")
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            raise AssertionError("the connection was still open")
        elapsed = time.monotonic() - t0
    assert REQUEST_READ_S - 0.5 < elapsed < bound
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def test_client_gone_before_the_first_step_is_aborted(limited: Server) -> None:
    """Four long requests fill the batch; a stream whose client leaves while it waits must
    be aborted, not run to max_tokens."""
    # NOTE: long enough that the four stay in the batch well past the first poll (the
    # bundled model decodes thousands of tokens/s here); the wait below has a deadline
    long = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}
    before = limited.metrics()
    aborts = limited.metric("nybble:request_success_total", finished_reason="abort")

    async def go() -> None:
        async with httpx.AsyncClient(base_url=limited.url, timeout=120) as c:
            busy = [asyncio.ensure_future(c.post("/v1/completions", json=long))
                    for _ in range(4)]
            deadline = time.monotonic() + 60
            while limited.stats()["num_running"] < 4:
                assert not all(b.done() for b in busy), "the 4 requests never ran together"
                assert time.monotonic() < deadline, "the 4 requests never ran together"
                await asyncio.sleep(0.01)
            host, port = limited.url.removeprefix("http://").split(":")
            body = json.dumps({**long, "stream": True}).encode()
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: "
                          b"application/json\r\nContent-Length: " + str(len(body)).encode()
                          + b"\r\n\r\n" + body)
            # NOTE: closed at once: gone before its answer starts, so the body generator
            # may never run (its own finally cannot be what aborts the request)
            await asyncio.gather(*busy)

    asyncio.run(go())
    stats = limited.wait_idle()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    after = limited.metrics()
    generated = after["nybble:generation_tokens_total"] - before["nybble:generation_tokens_total"]
    assert generated < 5 * 480, "the abandoned stream ran to max_tokens"
    success = after["nybble:request_success_total"] - before.get("nybble:request_success_total",
                                                                 0.0)
    assert success == 5                                  # 4 "length" and the abort
    assert limited.metric("nybble:request_success_total", finished_reason="abort") == aborts + 1


@pytest.mark.parametrize("messages,says", [
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "Conversation roles must alternate"),
    ([{"role": "user", "content": "divide"}], "ZeroDivisionError"),
])
def test_a_chat_template_that_raises_is_400(limited: Server, messages: list[dict[str, str]],
                                             says: str) -> None:
    with httpx.Client(base_url=limited.url) as c:
        for path in ("/v1/chat/completions", "/tokenize"):
            error = _error(c.post(path, json={"messages": messages}), 400)
            assert error["type"] == "invalid_request_error" and error["param"] == "messages"
            assert says in str(error["message"])
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                               "content": "Hi"}],
                                                  "max_tokens": 3})
        assert ok.status_code == 200


def test_limits_are_in_help(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "nybble", "serve", "--help"],
                         capture_output=True, text=True, timeout=120).stdout
    for flag in ("--max-request-body-bytes", "--max-num-waiting-requests",
                 "--max-seqs-per-request", "--timeout-keep-alive", "--limit-concurrency",
                 "/health, /metrics and /version"):
        assert flag in " ".join(out.split()), flag
