"""Stress runs against a running ``nybble serve``: abandoned streams, and bursts.

- :func:`disconnect_round`: streaming completions (``ignore_eos``, so each must produce exactly
  its ``max_tokens``), ``concurrency`` at a time; a ``disconnect_fraction`` of the clients
  leave at a random point (before the answer starts, or after a random number of chunks). A
  client that stays must get every token and ``finish_reason: "length"``.
- :func:`burst`: ``num_requests`` non-streaming completions sent at once, each on its own
  connection; every one must be answered: 200, or a clear 503 (admission control, with
  ``Retry-After``) or 429; never a dropped connection or another status.
- :func:`server_state`: what the server holds afterwards (used KV blocks, the running and
  waiting gauges, the resident memory of both processes), to check that it went back to idle
  and that memory does not grow from round to round.

Loopback only: the runs are meant for a server on this machine (``benchmarks/serve_stress.py``
starts one); every loop is bounded.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from nybble.oslimits import raise_open_file_limit

PROMPTS = ("Once upon a time", "The little dog", "Lily and Tom went to the park.",
           "One day, a small bird", "The sun was hot and the sea was blue.", "Sam had a red car")


@dataclass
class DisconnectResult:
    """What one :func:`disconnect_round` saw (counts of requests; seconds)."""

    requests: int = 0
    stayed: int = 0
    completed_exactly: int = 0
    wrong: list[str] = field(default_factory=list)
    left_before_answer: int = 0
    left_mid_stream: int = 0
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, with at most 10 examples of each problem."""
        out = asdict(self)
        out["wrong"], out["errors"] = self.wrong[:10], self.errors[:10]
        out["num_wrong"], out["num_errors"] = len(self.wrong), len(self.errors)
        return out


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      leave_after: int | None) -> tuple[int, str | None]:
    """Stream one completion; leave after ``leave_after`` chunks (``None``: read it all).

    Returns:
        ``(tokens, finish_reason)`` of a stream read to its end (``usage`` tokens).

    Raises:
        RuntimeError: a status other than 200, an error event, or a stream without [DONE].
    """
    tokens, finish, done, chunks = -1, None, False, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices", ()):
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return tokens, None
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return tokens, finish


async def disconnect_round(base_url: str, num_requests: int = 1000, concurrency: int = 150,
                           disconnect_fraction: float = 0.2, max_tokens: tuple[int, int] = (8, 64),
                           seed: int = 0, api_key: str | None = None,
                           timeout_s: float = 600.0) -> DisconnectResult:
    """One round of streaming completions with random disconnects (see the module's doc).

    Args:
        max_tokens: each request's ``max_tokens`` is drawn uniformly from this range.
        seed: the round's random choices (the same seed gives the same round).
        timeout_s: per-request timeout (seconds).
    """
    rng = random.Random(seed)
    plans: list[tuple[int, int, float | None, int | None]] = []
    for i in range(num_requests):
        n_tokens = rng.randint(*max_tokens)
        delay, chunks = None, None   # leave after `delay` seconds / after `chunks` chunks
        if rng.random() < disconnect_fraction:
            # a third leave before the answer starts, the rest after some chunks
            if rng.random() < 1 / 3:
                delay = rng.uniform(0.0, 0.05)
            else:
                chunks = rng.randint(1, n_tokens)
        plans.append((i, n_tokens, delay, chunks))
    result = DisconnectResult(requests=num_requests)
    gate = asyncio.Semaphore(concurrency)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, i: int, n_tokens: int, delay: float | None,
                  chunks: int | None) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": n_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with gate:
            try:
                if delay is not None:
                    task = asyncio.ensure_future(_stream_one(client, url, body, None))
                    await asyncio.sleep(delay)
                    task.cancel()
                    try:
                        await task
                        result.stayed += 1        # NOTE: it finished before we left
                        result.completed_exactly += 1
                    except asyncio.CancelledError:
                        result.left_before_answer += 1
                    return
                tokens, finish = await _stream_one(client, url, body, chunks)
            except Exception as e:  # noqa: BLE001 -- every failure is a finding: count it
                result.errors.append(f"request {i}: {type(e).__name__}: {e}")
                return
            if chunks is not None:
                result.left_mid_stream += 1
                return
            result.stayed += 1
            if tokens == n_tokens and finish == "length":
                result.completed_exactly += 1
            else:
                result.wrong.append(f"request {i}: {tokens} tokens ({finish}), "
                                    f"expected {n_tokens} (length)")

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits,
                                 headers=_headers(api_key)) as client:
        await asyncio.gather(*(one(client, *plan) for plan in plans))
    result.duration_s = time.perf_counter() - t0
    return result


async def burst(base_url: str, num_requests: int = 2000, max_tokens: int = 16,
                api_key: str | None = None, timeout_s: float = 900.0,
                pids: tuple[int, ...] = ()) -> dict[str, Any]:
    """``num_requests`` completions at once, one connection each (see the module's doc).

    Args:
        pids: server processes whose resident memory is sampled during the burst.

    Returns:
        Counts by status (``statuses``), dropped connections (``errors``), how many 503s
        carried ``Retry-After``, the duration and the peak resident memory of ``pids``.
    """
    raise_open_file_limit(num_requests + 256)
    url = base_url.rstrip("/") + "/v1/completions"
    statuses: dict[str, int] = {}
    errors: list[str] = []
    retry_after = 0
    wrong = 0
    peak = dict.fromkeys(pids, 0)
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            for pid in pids:
                peak[pid] = max(peak[pid], rss_bytes(pid))
            await asyncio.sleep(0.05)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal retry_after, wrong
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        try:
            r = await client.post(url, json=body)
        except httpx.HTTPError as e:
            errors.append(f"request {i}: {type(e).__name__}: {e}")
            return
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        if r.status_code == 503 and "retry-after" in r.headers:
            retry_after += 1
        if r.status_code == 200 and r.json()["usage"]["completion_tokens"] != max_tokens:
            wrong += 1

    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=0)
    sampler = asyncio.ensure_future(sample())
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits,
                                 headers=_headers(api_key)) as client:
        await asyncio.gather(*(one(client, i) for i in range(num_requests)))
    duration = time.perf_counter() - t0
    done.set()
    await sampler
    return {"requests": num_requests, "statuses": statuses, "num_errors": len(errors),
            "errors": errors[:10], "503_with_retry_after": retry_after,
            "200_with_wrong_tokens": wrong, "duration_s": duration,
            "peak_rss_bytes": {str(pid): v for pid, v in peak.items()}}


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux ``/proc``; 0 if unknown)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def server_state(base_url: str, pids: tuple[int, ...] = (),
                 api_key: str | None = None) -> dict[str, Any]:
    """Used KV blocks, running/waiting (engine stats and the Prometheus gauges) and the
    resident memory of ``pids`` (bytes), read now."""
    with httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=60) as c:
        stats = c.get("/internal/stats").json()
        gauges: dict[str, float] = {}
        for line in c.get("/metrics").text.splitlines():
            for name in ("nybble:num_requests_running", "nybble:num_requests_waiting"):
                if line.startswith(name + "{"):
                    gauges[name] = float(line.rsplit(" ", 1)[1])
    return {"used_kv_blocks": stats["num_blocks"] - stats["num_free_blocks"],
            "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
            "gauge_running": gauges.get("nybble:num_requests_running"),
            "gauge_waiting": gauges.get("nybble:num_requests_waiting"),
            "rss_bytes": {str(pid): rss_bytes(pid) for pid in pids}}


def wait_idle(base_url: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
    """Poll until the engine runs and waits for nothing.

    Raises:
        TimeoutError: still busy after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=60) as c:
        while True:
            stats = c.get("/internal/stats").json()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server is still busy after {timeout_s} s: {stats}")
            time.sleep(0.1)


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found
