"""A real ``nybble serve`` on the bundled model, on a free loopback port, for the whole session.

The server runs as a subprocess (``python -m nybble serve``: the API process, which starts
the engine-core process), so the tests exercise the CLI, uvicorn and both processes exactly
as a user would; it is stopped with SIGINT at the end.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "nybble-test-key"
STARTUP_TIMEOUT_S = 180.0   # shared CI machines can be slow to import torch


@dataclass(frozen=True)
class Server:
    """A running test server: base ``url`` (no ``/v1``), its ``api_key``, log file and the
    API process's ``pid``."""

    url: str
    api_key: str
    log_path: Path
    pid: int = 0

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        """The official client pointed at this server."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0,
                             **kwargs)

    def async_openai(self) -> openai.AsyncOpenAI:
        """The official async client pointed at this server."""
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key,
                                  max_retries=0, timeout=300)

    def http(self, auth: bool = True) -> httpx.Client:
        """An httpx client, with the ``Authorization`` header unless ``auth`` is false."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if auth and self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def stats(self) -> dict[str, Any]:
        """``GET /internal/stats``: the engine's counters."""
        with self.http() as c:
            r = c.get("/internal/stats")
            r.raise_for_status()
            return dict(r.json())

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Poll the engine until nothing runs or waits; returns the idle stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout_s} s: {stats}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Every ``/metrics`` sample labelled with the served model, by sample name
        (``request_success_total`` summed over ``finished_reason``; buckets skipped)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("model_name") != "stories260k" or s.name.endswith("_bucket"):
                    continue
                values[s.name] = values.get(s.name, 0.0) + s.value
        return values

    def metric(self, name: str, **labels: str) -> float:
        """One ``/metrics`` sample of the served model, summed over the labels not given."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples
                   if s.name == name and s.labels.get("model_name") == "stories260k"
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(log_path: Path, *extra: str,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Launch ``nybble serve`` and wait until ``/health`` answers; returns (process, url).

    Raises:
        RuntimeError: the process exited or did not become healthy in time (log attached).
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "nybble", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level", "warning", *extra]
    full_env = {k: v for k, v in os.environ.items() if k != "NYBBLE_API_KEY"}
    full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nybble serve exited with {proc.returncode}:\n"
                               + log_path.read_text(errors="replace")[-4000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError("nybble serve did not become healthy:\n"
                       + log_path.read_text(errors="replace")[-4000:])


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (uvicorn's graceful shutdown), then kill if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server with an API key for the whole test session."""
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    proc, url = start_server(log_path, "--api-key", API_KEY, "--stats-interval", "1")
    try:
        yield Server(url=url, api_key=API_KEY, log_path=log_path, pid=proc.pid)
    finally:
        stop_server(proc)


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    """The official ``openai`` client for the session server."""
    return server.openai()


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # NOTE: field 4 is the parent pid; the name (field 2) may hold spaces
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def core_pid(api_pid: int, timeout_s: float = 30.0) -> int:
    """The engine-core process of the server whose API process is ``api_pid``.

    NOTE: the core is started first thing, so right after the server starts its child may
    still show the parent's command line (between fork and exec): wait for the exec."""
    deadline = time.monotonic() + timeout_s
    while True:
        (pid,) = children(api_pid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"nybble.runtime.engine.core_process" in f.read():
                return pid
        assert time.monotonic() < deadline, f"child {pid} of {api_pid} is not an engine core"
        time.sleep(0.02)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
