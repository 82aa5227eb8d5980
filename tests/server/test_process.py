"""The two processes of ``nybble serve``: the API process stays torch-free; the engine core's
death fails the requests in flight and turns the server unhealthy; signals shut down cleanly
(requests in flight end with an abort chunk or a JSON error), and never leave the core behind;
a start-up error in the core is one line and exit code 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from nybble.runtime.frontend.core_spawn import OWNER_FILE, sweep_stale_folders

from tests.server.conftest import (
    Server,
    _free_port,
    children,
    core_pid,
    pid_alive,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.server]

LONG = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 480,
        "ignore_eos": True, "temperature": 0.0}
EXIT_BOUND_S = 10.0
"""Generous bound for "the process is gone" checks on a loaded machine (the design: < 5 s)."""


def _wait_gone(pid: int, timeout_s: float = EXIT_BOUND_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_running(url: str, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/internal/stats", timeout=30).json()["num_running"] < n:
        assert time.monotonic() < deadline, f"{n} requests never ran together"
        time.sleep(0.02)


class _Stream(threading.Thread):
    """A streaming completion read to its end on a thread; ``events`` are its ``data:``
    payloads."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.events, self.status = url, [], 0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])


class _Blocking(threading.Thread):
    """A non-streaming completion on a thread; ``result`` is ``(status, json body)``."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.result = url, (0, {})

    def run(self) -> None:
        r = httpx.post(f"{self.url}/v1/completions", json=LONG, timeout=60)
        self.result = (r.status_code, r.json())


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_api_process_never_loads_torch(server: Server) -> None:
    with server.http() as c:
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert "libtorch" not in _maps(server.pid)
    assert "libtorch" in _maps(core_pid(server.pid))   # the check can see torch where it is


@pytest.mark.slow
def test_core_death_fails_requests_and_turns_unhealthy(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    # NOTE: eager, so the two 480-token requests surely overlap (the fused step ends each in
    # a fraction of a second, and one could finish before the other is admitted)
    proc, url = start_server(log, "--enforce-eager")
    try:
        stream, blocking = _Stream(url), _Blocking(url)
        stream.start()
        blocking.start()
        _wait_running(url, 2)
        os.kill(core_pid(proc.pid), signal.SIGKILL)
        stream.join(60)
        blocking.join(60)
        assert stream.status == 200 and stream.events[-1] == "[DONE]"
        error = json.loads(stream.events[-2])["error"]
        assert error["code"] == 503 and "engine core process exited" in error["message"]
        status, body = blocking.result
        assert status == 503 and body["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == 503
        assert httpx.get(f"{url}/internal/stats", timeout=10).status_code == 503
    finally:
        stop_server(proc)
    assert proc.returncode == 0
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_core_never_outlives_the_api_process(tmp_path: Path, sig: int) -> None:
    """... and its socket folder goes: at shutdown, or (SIGKILL) at the next start-up's sweep."""
    proc, _ = start_server(tmp_path / "serve.log")
    try:
        core = core_pid(proc.pid)
        with open(f"/proc/{core}/cmdline", "rb") as f:
            args = f.read().decode().split("\0")
        folder = os.path.dirname(args[args.index("--input-address") + 1].removeprefix("ipc://"))
        with open(os.path.join(folder, OWNER_FILE)) as f:
            assert int(f.read()) == proc.pid
        os.kill(proc.pid, sig)
        proc.wait(timeout=EXIT_BOUND_S)
        assert _wait_gone(core), "the engine core outlived the API process"
    finally:
        stop_server(proc)
    assert proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    if sig == signal.SIGKILL:   # no chance to clean up: the next `nybble serve` sweeps it
        assert os.path.isdir(folder)
        assert folder in sweep_stale_folders()
    assert not os.path.exists(folder)


@pytest.mark.slow
def test_sigterm_ends_requests_in_flight_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    # NOTE: the eager path (several times slower per step than the fused CPU step) leaves the
    # 480-token requests seconds, not a fraction of one, between "all running" and the signal
    proc, url = start_server(log, "--enforce-eager")
    try:
        core = core_pid(proc.pid)
        streams = [_Stream(url) for _ in range(3)]
        blocking = _Blocking(url)
        for t in (*streams, blocking):
            t.start()
        _wait_running(url, 4)
        deadline = time.monotonic() + 60
        while not all(s.events for s in streams):   # every stream has begun, none has ended
            assert time.monotonic() < deadline, "the streams never began"
            time.sleep(0.01)
        assert not any(s.events[-1] == "[DONE]" for s in streams), "a stream ended too soon"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=EXIT_BOUND_S)
        for t in (*streams, blocking):
            t.join(30)
    finally:
        stop_server(proc)
    assert proc.returncode == 0
    assert _wait_gone(core)
    for s in streams:
        assert s.status == 200 and s.events[-1] == "[DONE]"
        last: dict[str, Any] = json.loads(s.events[-2])
        assert last["choices"][0]["finish_reason"] == "abort"
    status, body = blocking.result
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert "Traceback" not in log.read_text()


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc, _ = start_server(tmp_path / "serve.log")
    try:
        core = core_pid(proc.pid)
        # NOTE: two different signals: two pending SIGINTs can merge into one delivery when
        # the server is not scheduled between them (a loaded machine), two kinds cannot
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=EXIT_BOUND_S)
    finally:
        stop_server(proc)
    # the immediate exit (code of whichever was handled second), not the graceful 0
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM)
    assert _wait_gone(core)


@pytest.mark.slow
def test_core_start_up_error_is_one_line_and_exit_code_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "nybble", "serve", "--port",
                           str(_free_port()), "--max-model-len", "100000"],
                          capture_output=True, text=True, timeout=180, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "nybble serve: error: max_model_len must be <= 512 (the model's position limit), "
        "got 100000")
    assert "Traceback" not in proc.stderr


def test_missing_model_folder_fails_before_starting_the_core(tmp_path: Path) -> None:
    missing, a_file = tmp_path / "nope", tmp_path / "file"
    a_file.write_text("x")
    for path, what in ((missing, "does not exist"), (a_file, "is a file, expected a folder")):
        proc = subprocess.run([sys.executable, "-m", "nybble", "serve", str(path), "--port",
                               str(_free_port())], capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and what in proc.stderr, proc.stderr


@pytest.mark.slow
def test_http_answers_while_the_core_loads_and_requests_wait_for_it(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "nybble", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 60
        while not children(proc.pid):   # NOTE: the core is spawned first thing
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.002)
        core = core_pid(proc.pid)
        os.kill(core, signal.SIGSTOP)   # hold the core before its handshake
        health = None
        while health is None:
            try:
                health = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.02)
        assert health == 503            # listening, the engine not ready
        early = _Blocking(url)
        early.start()
        time.sleep(0.5)
        assert early.is_alive()         # waiting for the engine, not refused
        os.kill(core, signal.SIGCONT)
        early.join(120)
        status, body = early.result
        assert status == 200 and body["usage"]["completion_tokens"] == 480
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        stop_server(proc)
