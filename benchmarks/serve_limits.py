"""``/health`` latency while one large request runs (issue 15: under 100 ms).

Starts ``nybble serve`` (bundled model) on a free loopback port; for each case sends one large
request while a second client polls ``GET /health`` every 5 ms, and reports the request's
status and time and the ``/health`` latencies (median, p99, max) meanwhile. The cases are the
largest of each kind the default limits let through: a 2 MiB body of token ids (refused by the
gate: too long), a 2 MiB ``/tokenize`` text (1 M tokens answered), a 2 MiB chat conversation
(refused by the length check before its template runs), a 2 MiB ``/detokenize``, 1024
prompts in one request, and ``n = 64`` x 400 tokens with 20 logprobs each, JSON and streamed.

Usage: ``python benchmarks/serve_limits.py [--case NAME ...]``; prints a table and writes
``benchmarks/results/serve_limits.json``. Timings: the machine's load average is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble.bench.report import print_table, write_json
from nybble.bench.serve import launched_server_process
from nybble.config import DEFAULT_MODEL
from nybble.server.config import DEFAULT_MAX_REQUEST_BODY_BYTES

LIMIT = DEFAULT_MAX_REQUEST_BODY_BYTES - 64     # bytes: the largest body accepted, less slack


def _ids(limit: int) -> list[int]:
    """Token ids (3-digit) filling about ``limit`` bytes of JSON."""
    return [100 + i % 400 for i in range(limit // 5)]


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """``name -> (path, body)``."""
    lp = {"n": 64, "max_tokens": 400, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
            "top_logprobs": 20, **lp}
    return {
        "ids-prompt": ("/v1/completions", {"prompt": _ids(LIMIT)}),
        "tokenize-text": ("/tokenize", {"prompt": "a " * (LIMIT // 2 - 16)}),
        "detokenize": ("/detokenize", {"tokens": _ids(LIMIT)}),
        "chat-big": ("/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hello " * (LIMIT // 6 - 8)}]}),
        "many-prompts": ("/v1/completions",
                         {"prompt": [f"Once upon a time {i}" for i in range(1024)],
                          "max_tokens": 8}),
        "logprobs-n64": ("/v1/completions", {"prompt": "Once upon a time", "logprobs": 20,
                                             **lp}),
        "chat-logprobs-n64": ("/v1/chat/completions", chat),
        "chat-logprobs-n64-stream": ("/v1/chat/completions", {**chat, "stream": True}),
    }


def one_case(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send ``body`` while polling /health; the request's figures and the poll latencies."""
    content = json.dumps(body).encode()
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                c.get("/health")
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    r = httpx.post(url + path, content=content, timeout=600,
                   headers={"Content-Type": "application/json"})
    elapsed = time.perf_counter() - t0
    done.set()
    poller.join()
    latencies.sort()
    return {"status": r.status_code, "body_MiB": round(len(content) / 2**20, 2),
            "answer_MiB": round(len(r.content) / 2**20, 2), "request_s": round(elapsed, 2),
            "polls": len(latencies),
            "health_p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
            "health_p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1),
            "health_max_ms": round(1000 * latencies[-1], 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=list(cases()),
                   help="run only these cases (default: all)")
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                    "serve_limits.json"))
    args = p.parse_args()
    rows = []
    load = os.getloadavg()[0]
    with launched_server_process(DEFAULT_MODEL, ("--uvicorn-log-level", "warning"),
                                 300.0) as (url, _):
        for name, (path, body) in cases().items():
            if args.case and name not in args.case:
                continue
            rows.append({"case": name, **one_case(url, path, body)})
            print(rows[-1], flush=True)
    print_table(rows, title=f"/health during one large request (load average {load:.1f})")
    write_json(args.output, {"benchmark": "serve_limits", "load_1m": load, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
