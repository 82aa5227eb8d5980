"""The async load generator of ``nybble bench serve`` (vLLM ``bench serve`` methodology).

Requests arrive as a Poisson process (exponential gaps of mean ``1 / rate`` seconds, seeded;
``rate = inf`` sends everything at t = 0); an ``asyncio.Semaphore`` caps in-flight requests
independently of arrivals. Each request streams ``/v1/completions`` (prompt as token ids,
greedy, ``ignore_eos``, ``stream_options.include_usage``) over one shared httpx client.

Per request (client clock, seconds): TTFT = first chunk carrying ``choices`` - send; ITL = gaps
between consecutive such chunks; e2e = last chunk - send; TPOT = (e2e - TTFT) / (tokens - 1).
Output tokens come from the final ``usage`` chunk (falling back to the number of chunks).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from nybble.bench.report import summarize
from nybble.bench.workloads import BenchRequest


@dataclass
class RequestRecord:
    """What one streamed request measured (seconds, tokens)."""

    prompt_len: int
    requested_len: int
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0


async def _one_request(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                       headers: dict[str, str]) -> RequestRecord:
    rec = RequestRecord(req.prompt_len, req.output_len)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                now = time.perf_counter()
                if msg.get("error"):
                    rec.error = str(msg["error"])[:300]
                    return rec
                if msg.get("choices"):
                    if chunks == 0:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    chunks += 1
                if msg.get("usage"):
                    usage_tokens = int(msg["usage"].get("completion_tokens", 0))
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    rec.e2e_s = last - start
    rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
    rec.success = chunks > 0
    if not rec.success:
        rec.error = "stream ended without any completion chunk"
    return rec


def arrival_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """Send times of ``n`` requests in seconds from the start (Poisson process of ``rate``/s)."""
    if np.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_load(base_url: str, model: str, requests: list[BenchRequest], rate: float,
                   max_concurrency: int | None, seed: int = 0,
                   api_key: str | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at ``rate``/s; returns the records and the wall duration (s)."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    offsets = arrival_offsets(len(requests), rate, seed)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def gated(req: BenchRequest) -> RequestRecord:
            async with sem:
                return await _one_request(client, url, model, req, headers)

        start = time.perf_counter()
        tasks = []
        for req, off in zip(requests, offsets):
            delay = start + float(off) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(req)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(records), duration


def aggregate(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """vLLM's serving metrics: throughput, TTFT / TPOT / ITL / e2e mean, median, p90, p99 (ms)."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    res: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "requested_output_tokens": sum(r.requested_len for r in records),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s}
    res.update(summarize([r.ttft_s for r in ok], "ttft"))
    res.update(summarize(tpot, "tpot"))
    res.update(summarize([g for r in ok for g in r.itl_s], "itl"))
    res.update(summarize([r.e2e_s for r in ok], "e2el"))
    res["errors"] = sorted({r.error for r in records if not r.success})[:5]
    return res
