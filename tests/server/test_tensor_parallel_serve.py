"""``nybble serve --tensor-parallel-size 2``: answers like one rank; when its worker dies,
``/health`` turns 503 without a request (the engine core finds it idle) and requests get 503;
stopping the server leaves no worker behind."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import children, core_pid, pid_alive, start_server, stop_server

BODY = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 12,
        "temperature": 0}


def _text(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.mark.server
@pytest.mark.slow
def test_tp2_server_answers_and_a_dead_worker_turns_it_unhealthy(tmp_path: Path) -> None:
    one, url1 = start_server(tmp_path / "tp1.log", "--threads", "1")
    try:
        expected = _text(url1)
    finally:
        stop_server(one)
    proc, url = start_server(tmp_path / "tp2.log", "--tensor-parallel-size", "2",
                             "--threads", "1")
    try:
        assert _text(url) == expected
        (worker,) = children(core_pid(proc.pid))
        with open(f"/proc/{worker}/cmdline", "rb") as f:
            assert b"nybble.runtime.executor.tp_worker" in f.read()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 after the worker died"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        stop_server(proc)


@pytest.mark.server
@pytest.mark.slow
def test_stopping_a_tp2_server_stops_its_worker(tmp_path: Path) -> None:
    proc, _ = start_server(tmp_path / "tp2.log", "--tensor-parallel-size", "2", "--threads", "1")
    try:
        (worker,) = children(core_pid(proc.pid))
    finally:
        stop_server(proc)
    deadline = time.monotonic() + 10
    while pid_alive(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived the server"
        time.sleep(0.1)
