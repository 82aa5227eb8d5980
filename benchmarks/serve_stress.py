"""Abandoned streams and bursts against ``nybble serve`` (issue 15's load figures).

Starts ``nybble serve`` (bundled model unless ``--model``) on a free loopback port and runs
(``nybble.bench.serve_stress``):

1. ``--rounds`` identical rounds of ``--requests`` streaming completions, ``--concurrency`` at
   a time, ``--disconnect`` of the clients leaving at random points. Every client that stays
   must get exactly its ``max_tokens`` (``ignore_eos``) and ``finish_reason: "length"``; after
   each round the server must hold 0 KV blocks with the running/waiting gauges at 0, and the
   resident memory after the last round must be within 5% of after the first.
2. A burst of ``--burst`` completions at once, one connection each: every request answered
   (200, or 503 with ``Retry-After`` from admission control); the servers' peak memory.

Usage: ``python benchmarks/serve_stress.py [--requests 1000] [--concurrency 150]
[--disconnect 0.2] [--rounds 2] [--burst 2000] [--serve-args "..."]``; prints the figures and
writes ``benchmarks/results/serve_stress.json``. Exit code 1 if any check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble.bench.report import write_json
from nybble.bench.serve import launched_server_process
from nybble.bench.serve_stress import (
    burst,
    children_of,
    disconnect_round,
    server_state,
    wait_idle,
)
from nybble.config import DEFAULT_MODEL

API_KEY = "stress-key"


def idle_checks(state: dict[str, object]) -> list[str]:
    """What is wrong with a server that should be idle."""
    wrong = []
    for key in ("used_kv_blocks", "num_running", "num_waiting", "gauge_running",
                "gauge_waiting"):
        if state[key] != 0:
            wrong.append(f"{key} = {state[key]} after the round")
    return wrong


def rounds_of_disconnects(url: str, pids: tuple[int, ...], args: argparse.Namespace,
                          problems: list[str]) -> dict[str, Any]:
    """The identical rounds of abandoned streams, the server's state after each."""
    rounds = []
    for r in range(args.rounds):
        res = asyncio.run(disconnect_round(url, args.requests, args.concurrency,
                                           args.disconnect, seed=0, api_key=API_KEY))
        wait_idle(url, API_KEY)
        state = server_state(url, pids, API_KEY)
        rounds.append({"result": res.as_dict(), "after": state})
        problems += [f"round {r + 1}: {w}" for w in idle_checks(state)]
        if res.errors or res.wrong:
            problems.append(f"round {r + 1}: {len(res.errors)} errors, {len(res.wrong)} "
                            f"wrong token counts")
        print(f"round {r + 1}: {res.requests} streams in {res.duration_s:.1f} s; "
              f"{res.stayed} stayed, {res.completed_exactly} exact; left "
              f"{res.left_before_answer} before the answer, {res.left_mid_stream} mid-stream; "
              f"{len(res.errors)} errors; after: {state}", flush=True)
    growth = {pid: rounds[-1]["after"]["rss_bytes"][pid] / rounds[0]["after"]["rss_bytes"][pid]
              - 1 for pid in map(str, pids)}
    print("RSS growth from round 1 to the last, per process:",
          {k: f"{v:+.1%}" for k, v in growth.items()})
    problems += [f"RSS of {pid} grew {g:+.1%}" for pid, g in growth.items() if g > 0.05]
    return {"rounds": rounds, "rss_growth": growth}


def one_burst(url: str, pids: tuple[int, ...], args: argparse.Namespace,
              problems: list[str]) -> dict[str, Any]:
    """The burst, the servers' memory before, at the peak and after."""
    before = server_state(url, pids, API_KEY)["rss_bytes"]
    b = asyncio.run(burst(url, args.burst, args.burst_max_tokens, API_KEY, pids=pids))
    wait_idle(url, API_KEY)
    after = server_state(url, pids, API_KEY)
    problems += [f"burst: {w}" for w in idle_checks(after)]
    unclear = {s: n for s, n in b["statuses"].items() if s not in ("200", "503", "429")}
    if b["num_errors"] or unclear or b["200_with_wrong_tokens"] or \
            b["503_with_retry_after"] != b["statuses"].get("503", 0):
        problems.append(f"burst: {b['num_errors']} dropped, other statuses {unclear}")
    print(f"burst of {args.burst}: {b['statuses']} in {b['duration_s']:.1f} s, "
          f"{b['num_errors']} dropped; RSS before {before}, peak {b['peak_rss_bytes']}, "
          f"after {after['rss_bytes']}")
    return {"burst": b, "rss_before": before, "after": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=150)
    p.add_argument("--disconnect", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--burst", type=int, default=2000)
    p.add_argument("--burst-max-tokens", type=int, default=16)
    p.add_argument("--serve-args", default="", help="extra nybble serve flags, one string")
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                    "serve_stress.json"))
    args = p.parse_args()
    problems: list[str] = []
    serve_args = ("--api-key", API_KEY, "--uvicorn-log-level", "warning",
                  *shlex.split(args.serve_args))
    with launched_server_process(DEFAULT_MODEL, serve_args, 300.0) as (url, pid):
        pids = (pid, *children_of(pid))
        disconnects = rounds_of_disconnects(url, pids, args, problems)
        bursts = one_burst(url, pids, args, problems)
    write_json(args.output, {"benchmark": "serve_stress", "load_1m": os.getloadavg()[0],
                             "args": vars(args), "pids": {"api": pids[0], "core": pids[1:]},
                             **disconnects, "burst": bursts, "problems": problems})
    print("problems:", problems or "none")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
