"""A 500 carries a short message (no exception text) and keeps a keep-alive connection open;
uvicorn serves the app as ``nybble serve`` builds it (middleware, handlers, idle timeout)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from nybble.server.app import build_app
from nybble.server.config import ServerConfig
from nybble.server.connections import idle_timeout_protocol
from nybble.server.metrics import ServerMetrics

SECRET = "secret internal detail 0xdeadbeef"


@pytest.fixture(scope="module")
def app_url() -> Iterator[str]:
    app = build_app(ServerConfig(), ServerMetrics("test"))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError(SECRET)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="critical", http=idle_timeout_protocol(30.0),
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _exchange(conn: socket.socket, path: str) -> tuple[int, dict[str, str], bytes]:
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += conn.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_500_is_short_and_keeps_the_connection(app_url: str) -> None:
    host, port = app_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        for _ in range(3):
            status, headers, body = _exchange(conn, "/boom")
            assert status == 500 and headers.get("connection") != "close"
            error = json.loads(body)["error"]
            assert error["type"] == "internal_error" and error["code"] == 500
            assert SECRET not in error["message"] and "RuntimeError" not in error["message"]
            assert "error id" in error["message"]
        status, _, body = _exchange(conn, "/version")      # same connection, still open
        assert status == 200 and json.loads(body)["version"]
