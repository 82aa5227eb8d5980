"""nybble serve vs llama.cpp's ``llama-server``, side by side on the bundled model.

Both servers run at once on loopback ports, one thread each (nybble: ``OMP_NUM_THREADS=1``;
llama-server: ``-t 1 -tb 1 -np 16``, context ``512 * 16``, the GGUF conversion of the same
weights). Each workload sends ``N`` streaming ``/v1/completions`` at once (greedy,
``ignore_eos``, prompts of token ids cut from the held-out text, fixed output lengths) through
:mod:`nybble.bench.serve_client`; the two servers alternate, in swapped order every round, and
each figure is the median over ``--rounds`` rounds. Workloads (streams x output tokens):
1 x 256, 16 x 64, 64 x 128. How to build the peer: ``docs/peers.md`` of the shared folder.

Usage::

    python benchmarks/peer_llamacpp.py --llama-server PATH/llama-server --gguf PATH/model-f32.gguf

Prints a table and writes ``benchmarks/results/peer_llamacpp.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble.bench.report import print_table, write_json
from nybble.bench.serve import free_port, launched_server, served_model_name, stop_process
from nybble.bench.serve_client import aggregate, run_load
from nybble.bench.workloads import BenchRequest, WorkloadConfig, build_requests
from nybble.config import DEFAULT_MODEL

WORKLOADS = ((1, 256), (16, 64), (64, 128))
PROMPT_LEN = 16
SLOTS = 16


@contextlib.contextmanager
def llama_server(binary: str, gguf: str, timeout_s: float = 60.0, threads: int = 1,
                 slots: int = SLOTS, ctx_per_slot: int = 512) -> Iterator[str]:
    """Run ``llama-server`` on a free loopback port; yields its URL.

    Args:
        threads: ``-t`` and ``-tb`` (decode and batch/prompt threads).
        slots: ``-np``, parallel sequences.
        ctx_per_slot: tokens each slot holds; ``-c`` is ``slots * ctx_per_slot`` (the server
            splits its context between the slots).

    Raises:
        RuntimeError: it exited or did not answer ``/health`` within ``timeout_s``.
    """
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
           "-c", str(ctx_per_slot * slots), "-np", str(slots), "-t", str(threads),
           "-tb", str(threads)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"llama-server exited with {proc.returncode}: "
                                       f"{log.read()[-2000:]!r}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not answer within {timeout_s:.0f}s")
                time.sleep(0.2)
            yield url
        finally:
            stop_process(proc)


def requests_for(tokenizer: Any, streams: int, output_len: int, dataset: str | None,
                 seed: int) -> list[BenchRequest]:
    """``streams`` requests of a ``PROMPT_LEN``-token prompt and ``output_len`` tokens."""
    cfg = WorkloadConfig(kind="fixed", num_requests=streams, input_len=PROMPT_LEN,
                         output_len=output_len, dataset=dataset, seed=seed)
    return build_requests(cfg, tokenizer)


def measure(url: str, requests: list[BenchRequest]) -> dict[str, Any]:
    """All requests at once, streamed; the aggregate (output tok/s, TTFT, ITL...)."""
    model = served_model_name(url, None)
    records, duration = asyncio.run(run_load(url, model, requests, float("inf"), None))
    return aggregate(records, duration)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", default="/work/scratch/llama/build/bin/llama-server")
    ap.add_argument("--gguf", default="/work/scratch/llama/model-f32.gguf")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="nybble's model (same weights)")
    ap.add_argument("--serve-args", default="", help="extra nybble serve flags")
    ap.add_argument("--dataset", default=os.path.join(ROOT, "..", "shared", "data",
                                                      "stories-heldout.txt"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                     "peer_llamacpp.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.model_max_length = 1 << 62   # the held-out text is tokenized whole
    dataset = args.dataset if os.path.exists(args.dataset) else None
    os.environ["OMP_NUM_THREADS"] = "1"   # the nybble server inherits it
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    load = [os.getloadavg()[0]]
    with launched_server(args.model, tuple(args.serve_args.split()), 300.0) as nybble_url, \
            llama_server(args.llama_server, args.gguf) as llama_url:
        servers = {"nybble": nybble_url, "llama-server": llama_url}
        for url in servers.values():   # warm-up: first requests, allocations
            measure(url, requests_for(tokenizer, 4, 16, dataset, 99))
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for streams, out_len in WORKLOADS:
                reqs = requests_for(tokenizer, streams, out_len, dataset, r)
                for name in order:
                    res = measure(servers[name], reqs)
                    results.setdefault(f"{streams}x{out_len}", {}).setdefault(name, []) \
                        .append(res)
            load.append(os.getloadavg()[0])
    rows = []
    for key, by_server in results.items():
        med = {name: statistics.median(r["output_throughput"] for r in runs)
               for name, runs in by_server.items()}
        failed = sum(r["failed"] for runs in by_server.values() for r in runs)
        itl = {name: statistics.median(r["itl_median_ms"] for r in runs)
               for name, runs in by_server.items()}
        rows.append({"workload": key, "nybble_tok_s": med["nybble"],
                     "llama_tok_s": med["llama-server"],
                     "ratio": med["nybble"] / med["llama-server"],
                     "nybble_itl_p50_ms": itl["nybble"], "llama_itl_p50_ms": itl["llama-server"],
                     "failed": failed})
    print_table(rows, f"nybble serve vs llama-server, output tok/s, median of {args.rounds} "
                      f"alternating rounds, load {min(load):.2f}-{max(load):.2f}")
    write_json(args.output, {"rounds": args.rounds, "load_avg_1m": load,
                             "serve_args": args.serve_args, "rows": rows, "runs": results})
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
