"""A client that disconnects mid-stream aborts its request and frees its KV blocks."""
from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]


def test_disconnect_mid_stream_frees_blocks(server: Server) -> None:
    server.wait_idle()
    before = server.metrics()
    body = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 480,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    with server.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()   # NOTE: held, so the stream stays open until the with ends
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        running = server.stats()
    # closing the response closed the connection: the server aborts the request
    assert running["num_running"] == 1
    assert running["num_free_blocks"] < running["num_blocks"], "the stream held no blocks"
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["kv_cache_usage"] == 0.0
    generated = server.metrics()["nybble:generation_tokens_total"] - \
        before["nybble:generation_tokens_total"]
    assert generated < 480, "the request ran to the end instead of being aborted"
    # the server still answers normally afterwards
    with server.http() as c:
        ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200


def test_disconnect_while_waiting_for_a_json_response_aborts(server: Server) -> None:
    server.wait_idle()
    before = server.metrics()
    # NOTE: 4 samples of 480 tokens: long enough to outlast the disconnect check
    body = json.dumps({"model": "stories260k", "prompt": "Once upon a time", "n": 4,
                       "max_tokens": 480, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Authorization: Bearer " + server.api_key.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        for _ in range(10_000):          # until the engine runs it (bounded)
            if server.stats()["num_running"] >= 1:
                break
        else:
            raise AssertionError("the request never started running")
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    generated = server.metrics()["nybble:generation_tokens_total"] - \
        before["nybble:generation_tokens_total"]
    assert generated < 4 * 480, "the request ran to the end instead of being aborted"
