"""API fuzzing of ``nybble serve`` with schemathesis against its own ``/openapi.json``.

Starts ``nybble serve`` (bundled model, an API key) on a free loopback port, records a greedy
completion, then sends ``--examples`` schema-following and as many schema-breaking requests
per operation (every route; ``nybble.bench.serve_fuzz``), checking every answer: no 5xx, no
dropped connection, no answer the schema does not document (status, content type, headers,
body), every schema-breaking request refused with a 4xx. Afterwards the same greedy completion
must give the same text, the server must be healthy and idle.

Usage: ``python benchmarks/api_fuzz.py [--examples 850] [--workers 8]``; prints the figures
and writes ``benchmarks/results/api_fuzz.json``. Exit code 1 if any check failed.
"""
from __future__ import annotations

import argparse
import os
import sys

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble.bench.report import write_json
from nybble.bench.serve import launched_server_process
from nybble.bench.serve_fuzz import fuzz
from nybble.bench.serve_stress import server_state, wait_idle
from nybble.config import DEFAULT_MODEL

API_KEY = "fuzz-key"
GREEDY = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0.0}


def greedy_text(url: str) -> str:
    """The text of the reference greedy completion."""
    r = httpx.post(url + "/v1/completions", json=GREEDY, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=850,
                   help="schema-following cases per operation, and as many breaking it")
    p.add_argument("--workers", type=int, default=8, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a request may take before the client gives up (counted as "
                        "dropped)")
    p.add_argument("--serve-args", default="", help="extra nybble serve flags, one string")
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                    "api_fuzz.json"))
    args = p.parse_args()
    serve_args = ("--api-key", API_KEY, "--uvicorn-log-level", "warning",
                  *args.serve_args.split())
    with launched_server_process(DEFAULT_MODEL, serve_args, 300.0) as (url, _):
        before = greedy_text(url)
        result = fuzz(url, args.examples, API_KEY, args.workers, args.seed, args.timeout)
        wait_idle(url, API_KEY)
        after = greedy_text(url)
        healthy = httpx.get(url + "/health", timeout=30).status_code == 200
        state = server_state(url, api_key=API_KEY)
    figures = result.as_dict()
    problems = []
    if figures["server_errors"] or figures["dropped_connections"] or \
            figures["schema_violations"]:
        problems.append("the fuzzer found failures")
    if after != before:
        problems.append(f"greedy text changed: {before!r} -> {after!r}")
    if not healthy or state["used_kv_blocks"] or state["num_running"]:
        problems.append(f"not healthy and idle afterwards: {state}")
    print(f"{figures['requests']} requests in {figures['duration_s']:.0f} s "
          f"({figures['by_operation']}); statuses {figures['by_status']}; 5xx "
          f"{figures['server_errors']}, dropped {figures['dropped_connections']}, schema "
          f"violations {figures['schema_violations']} {figures['violations']}; greedy text "
          f"{'unchanged' if after == before else 'CHANGED'}; healthy {healthy}")
    for example in figures["examples"]:
        print("  ", example)
    write_json(args.output, {"benchmark": "api_fuzz", "load_1m": os.getloadavg()[0],
                             "args": vars(args), **figures, "greedy_before": before,
                             "greedy_after": after, "healthy_after": healthy,
                             "after": state, "problems": problems})
    print("problems:", problems or "none")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
