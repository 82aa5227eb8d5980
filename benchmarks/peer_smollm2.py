"""nybble serve vs llama.cpp's ``llama-server`` on SmolLM2-135M-Instruct, the same weights.

Three pairs, each one set of float values (``benchmarks/smollm2_artifacts.sh`` makes them all
from the Q4_1 GGUF in the shared folder):

=======  ===============================  ===================================
model    nybble serves                    llama-server serves
=======  ===============================  ===================================
fp32     the float32 HF folder            its F32 GGUF (``convert_hf_to_gguf``)
int8     ``nybble quantize`` RTN 8-bit    ``llama-quantize ... Q8_0``
         g32 symmetric
int4     ``nybble quantize`` RTN 4-bit    ``llama-quantize ... Q4_0``
         g32 symmetric
int4-    the same with                    ``llama-quantize ... Q4_0``
head     ``--quantize-lm-head``
=======  ===============================  ===================================

and, since nybble reads GGUF, three pairs of one file served by both: ``gguf-q4_0`` and
``gguf-q8_0`` (the ``llama-quantize`` files above) and ``gguf-q4_1`` (the published Q4_1 file
of the shared folder, copied into the artifacts). The HF folder's tokenizer (``hf-f32``) cuts
the prompts for every pair.

For every thread count (``--threads``: nybble ``--threads N`` and ``OMP_NUM_THREADS=N``;
llama-server ``-t N -tb N``) and model, both servers run at once on loopback ports and every
workload goes to each in turn, the order swapped every round (A, B, then B, A, ...); a figure is
the median over ``--rounds`` rounds. Workloads (``--workloads``):

* ``NxM``: ``N`` streaming ``/v1/completions`` at once, each a 16-token prompt cut from the
  held-out text and exactly ``M`` output tokens (temperature 0, ``ignore_eos``); the figure is
  output tokens / wall seconds. ``1x256``, ``16x64`` and ``64x128`` by default.
* ``prefillP``: one request with a ``P``-token prompt and ``max_tokens`` 1; the figure is prompt
  tokens / TTFT (prompt tokens/s). ``prefill1450`` by default.

Each round draws fresh prompts (the same for both servers and every model), so no prefix cache
helps. llama-server gets ``-np`` = the most streams of any workload and ``--max-model-len``
tokens per slot (``-c`` = slots x that), nybble ``--max-model-len`` and ``--kv-cache-memory``,
so every stream of every workload runs at once on both.

The run also measures the read bandwidth of each thread count (``_bandwidth.py``: a 512 MiB
float32 GEMV: torch's on 4 KiB and on 2 MiB pages, nybble's one-row loop on 2 MiB pages, on
that many threads, before and after the servers; the best call of any counts)
and reports batch-1 decode (the ``1xM`` workload) as a percentage of the weight-bandwidth limit:
that bandwidth / bytes of weights read per token, counted from the files as stored
(``_weight_bytes.py``: linear weights, scales and zero points, norms, the head as stored).

Usage::

    python benchmarks/peer_smollm2.py                      # all of it: about 45 min on 2 cores
    python benchmarks/peer_smollm2.py --models int4 --workloads 1x32,prefill256 --rounds 1 \\
        --threads 1 --output benchmarks/results/peer_smollm2-smoke.json

Prints the tables and writes ``benchmarks/results/peer_smollm2.json``; exits 1 when a request
failed or came back short.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # sibling helpers; run from a checkout without installing
from _bandwidth import read_bandwidth
from _weight_bytes import gguf_weight_bytes, safetensors_weight_bytes
from peer_llamacpp import PROMPT_LEN, llama_server, measure

from nybble.bench.report import print_table, write_json
from nybble.bench.serve import launched_server
from nybble.bench.workloads import BenchRequest, WorkloadConfig, build_requests

# name: (nybble folder, GGUF file, llama.cpp type), both under --artifacts
MODELS = {"fp32": ("hf-f32", "smollm2-f32.gguf", "F32"),
          "int8": ("nybble-int8-g32", "smollm2-q8_0.gguf", "Q8_0"),
          "int4": ("nybble-int4-g32", "smollm2-q4_0.gguf", "Q4_0"),
          "int4-head": ("nybble-int4-g32-head", "smollm2-q4_0.gguf", "Q4_0"),
          "gguf-q4_0": ("smollm2-q4_0.gguf", "smollm2-q4_0.gguf", "Q4_0"),
          "gguf-q8_0": ("smollm2-q8_0.gguf", "smollm2-q8_0.gguf", "Q8_0"),
          "gguf-q4_1": ("smollm2-q4_1.gguf", "smollm2-q4_1.gguf", "Q4_1")}
DEFAULT_WORKLOADS = "1x256,16x64,64x128,prefill1450"
SERVERS = ("nybble", "llama-server")


@dataclass(frozen=True)
class Workload:
    """One request set shape.

    Attributes:
        name: as given on the command line (``16x64``, ``prefill1450``).
        streams: requests sent at once.
        prompt_len: prompt tokens per request (BOS included).
        output_len: output tokens per request (``ignore_eos``).
        prefill: the figure is prompt tokens / TTFT instead of output tokens / wall time.
    """

    name: str
    streams: int
    prompt_len: int
    output_len: int
    prefill: bool


def parse_workload(text: str) -> Workload:
    """``"NxM"`` (N streams x M output tokens, 16-token prompts) or ``"prefillP"`` (one
    P-token prompt, one output token).

    Raises:
        ValueError: any other form, or a count below 1 (below 4 for a prompt).
    """
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if m and int(m[1]) >= 1 and int(m[2]) >= 1:
        return Workload(text, int(m[1]), PROMPT_LEN, int(m[2]), False)
    m = re.fullmatch(r"prefill(\d+)", text)
    if m and int(m[1]) >= 4:
        return Workload(text, 1, int(m[1]), 1, True)
    raise ValueError(f"workload {text!r}: allowed are NxM (N streams x M output tokens, "
                     f"N, M >= 1) and prefillP (one P-token prompt, P >= 4)")


def figure(w: Workload, agg: dict[str, Any]) -> float:
    """The workload's figure from :func:`measure`'s aggregate: prompt tokens/s over TTFT for a
    prefill, output tokens/s over the wall time otherwise."""
    if not agg["completed"]:
        return 0.0
    if w.prefill:
        return agg["total_input_tokens"] / (agg["ttft_mean_ms"] / 1e3)
    return float(agg["output_throughput"])


def request_sets(tokenizer: Any, workloads: list[Workload], rounds: int,
                 dataset: str | None) -> dict[tuple[str, int], list[BenchRequest]]:
    """The requests of every (workload, round), seeded so no two sets share a prompt start."""
    out = {}
    for i, w in enumerate(workloads):
        for r in range(rounds):
            cfg = WorkloadConfig(kind="fixed", num_requests=w.streams, input_len=w.prompt_len,
                                 output_len=w.output_len,
                                 context_budget=w.prompt_len + w.output_len,
                                 dataset=dataset, seed=1000 * (i + 1) + r)
            out[(w.name, r)] = build_requests(cfg, tokenizer)
    return out


def _median(runs: list[dict[str, Any]], w: Workload) -> float:
    return statistics.median(figure(w, r) for r in runs)


def _versions(llama_binary: str) -> dict[str, str]:
    """nybble's git commit and the first line of ``llama-server --version``."""
    def first_line(cmd: list[str], cwd: str | None = None) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=cwd)
        except (OSError, subprocess.SubprocessError) as e:
            return f"unknown ({e})"
        lines = (done.stdout + done.stderr).strip().splitlines()
        return lines[0] if lines else ""
    return {"nybble_commit": first_line(["git", "rev-parse", "HEAD"], ROOT),
            "llama_server": first_line([llama_binary, "--version"])}


def main() -> None:  # noqa: C901 - one linear script
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifacts", default="/work/scratch/smollm2",
                    help="folder benchmarks/smollm2_artifacts.sh wrote")
    ap.add_argument("--llama-server", default="/work/scratch/build/bin/llama-server")
    ap.add_argument("--llama-dir", default="/work/scratch/llama.cpp",
                    help="llama.cpp sources: gguf-py for the GGUF sizes if gguf is not installed")
    ap.add_argument("--models", default="fp32,int8,int4", help=f"subset of {','.join(MODELS)}")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                    help="comma-separated NxM / prefillP")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="nybble --max-model-len and llama-server's tokens per slot")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="nybble --kv-cache-memory")
    ap.add_argument("--serve-args", default="", help="extra nybble serve flags")
    ap.add_argument("--bandwidth-mib", type=int, default=512)
    ap.add_argument("--dataset", default=os.path.join(ROOT, "..", "shared", "data",
                                                      "stories-heldout.txt"))
    ap.add_argument("--output", default=os.path.join(HERE, "results", "peer_smollm2.json"))
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        ap.error(f"--models {args.models!r}: allowed are {', '.join(MODELS)}")
    try:
        workloads = [parse_workload(w) for w in args.workloads.split(",") if w]
        threads = [int(t) for t in args.threads.split(",") if t]
    except ValueError as e:
        ap.error(str(e))
    if not workloads or not threads or min(threads) < 1 or args.rounds < 1:
        ap.error("need at least one workload, thread counts >= 1 and --rounds >= 1")
    longest = max(w.prompt_len + w.output_len for w in workloads)
    if longest > args.max_model_len:
        ap.error(f"a workload needs {longest} tokens: raise --max-model-len "
                 f"({args.max_model_len})")
    paths = {m: (os.path.join(args.artifacts, MODELS[m][0]),
                 os.path.join(args.artifacts, MODELS[m][1])) for m in models}
    missing = [p for pair in paths.values() for p in pair if not os.path.exists(p)]
    if missing or not os.path.exists(args.llama_server):
        sys.exit(f"missing {missing or args.llama_server}: run benchmarks/smollm2_artifacts.sh "
                 f"(and build llama.cpp as benchmarks/README.md says)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.artifacts, "hf-f32"))
    tokenizer.model_max_length = 1 << 62   # the held-out text is tokenized whole
    dataset = args.dataset if os.path.exists(args.dataset) else None
    reqs = request_sets(tokenizer, workloads, args.rounds, dataset)
    weights = {m: {"nybble": (gguf_weight_bytes(paths[m][0], args.llama_dir)
                              if paths[m][0].endswith(".gguf") else
                              safetensors_weight_bytes(paths[m][0])),
                   "llama-server": gguf_weight_bytes(paths[m][1], args.llama_dir)}
               for m in models}
    slots = max(w.streams for w in workloads)
    started = time.time()
    bandwidth = {t: [read_bandwidth(args.bandwidth_mib << 20, threads=t)] for t in threads}
    for t in threads:
        b = bandwidth[t][0]
        print(f"read bandwidth, {t} thread(s), GB/s: torch mv {b['gemv_best_gb_s']:.1f} on 4 KiB "
              f"pages, {b['gemv_huge_best_gb_s']:.1f} on 2 MiB pages; nybble's one-row GEMV "
              f"{b.get('stream_huge_best_gb_s', float('nan')):.1f} on 2 MiB pages", flush=True)
    common_args = ("--max-model-len", str(args.max_model_len), "--kv-cache-memory",
                   args.kv_cache_memory, *args.serve_args.split())
    runs: dict[str, Any] = {}
    loads: list[float] = []
    for t in threads:
        os.environ["OMP_NUM_THREADS"] = str(t)   # the nybble server inherits it
        serve_args = ("--threads", str(t), *common_args)
        for m in models:
            with launched_server(paths[m][0], serve_args, 300.0) as nybble_url, \
                    llama_server(args.llama_server, paths[m][1], 120.0, threads=t,
                                 slots=slots, ctx_per_slot=args.max_model_len) as llama_url:
                urls = {"nybble": nybble_url, "llama-server": llama_url}
                warm = [parse_workload("4x16"), parse_workload("prefill256")]
                for url in urls.values():   # first requests, allocations
                    for ws in request_sets(tokenizer, warm, 1, dataset).values():
                        measure(url, ws)
                for r in range(args.rounds):
                    order = list(SERVERS) if r % 2 == 0 else list(reversed(SERVERS))
                    for w in workloads:
                        for name in order:
                            load = os.getloadavg()[0]
                            loads.append(load)
                            res = measure(urls[name], reqs[(w.name, r)])
                            res["load_avg_1m"] = load
                            res["figure"] = figure(w, res)
                            runs.setdefault(str(t), {}).setdefault(m, {}) \
                                .setdefault(w.name, {}).setdefault(name, []).append(res)
                            print(f"  threads {t} {m:4s} {w.name:>12s} round {r} {name:12s} "
                                  f"{res['figure']:8.1f} tok/s (load {load:.2f})", flush=True)
    for t in threads:
        bandwidth[t].append(read_bandwidth(args.bandwidth_mib << 20, threads=t))
    bw = {t: max(b["limit_gb_s"] for b in bandwidth[t]) * 1e9 for t in threads}

    rows, bw_rows, bad_runs = [], [], 0
    for t in threads:
        for w in workloads:
            row: dict[str, Any] = {"threads": t, "workload": w.name,
                                   "unit": "prompt tok/s" if w.prefill else "output tok/s"}
            for m in models:
                by = runs[str(t)][m][w.name]
                for name in SERVERS:
                    bad_runs += sum(r["failed"] + (r["total_output_tokens"]
                                                   != r["requested_output_tokens"])
                                    for r in by[name])
                nyb, lla = _median(by["nybble"], w), _median(by["llama-server"], w)
                row[f"nybble {m}"] = nyb
                row[f"llama {MODELS[m][2]}"] = lla
                row[f"x {m}"] = nyb / lla
            rows.append(row)
        batch1 = next((w for w in workloads if w.streams == 1 and not w.prefill), None)
        for m in models if batch1 else []:
            by = runs[str(t)][m][batch1.name]
            brow: dict[str, Any] = {"threads": t, "GB/s": bw[t] / 1e9, "model": m,
                                    "workload": batch1.name}
            for name, short in (("nybble", "nybble"), ("llama-server", "llama")):
                per_tok = weights[m][name]["per_token_bytes"]
                limit = bw[t] / per_tok
                tok_s = _median(by[name], batch1)
                brow[f"{short} MB/tok"] = per_tok / 1e6
                brow[f"{short} limit tok/s"] = limit
                brow[f"{short} tok/s"] = tok_s
                brow[f"{short} % limit"] = 100 * tok_s / limit
            bw_rows.append(brow)
    lo, hi = min(loads), max(loads)
    print_table(rows, f"nybble serve vs llama-server, SmolLM2-135M-Instruct, median of "
                      f"{args.rounds} alternating rounds, load {lo:.2f}-{hi:.2f}")
    if bw_rows:
        print_table(bw_rows, "batch-1 decode vs the weight-bandwidth limit (read bandwidth "
                             "of that many threads, the best GEMV)")
    write_json(args.output, {
        "rounds": args.rounds, "threads": threads, "models": models,
        "workloads": [w.__dict__ for w in workloads], "load_avg_1m_range": [lo, hi],
        "nybble_serve_args": ["--threads", "N", *common_args],
        "llama_server_args": {"np": slots, "c": slots * args.max_model_len, "t": "N",
                              "tb": "N"},
        "bandwidth": {str(t): v for t, v in bandwidth.items()},
        "bandwidth_gb_s": {str(t): v / 1e9 for t, v in bw.items()}, "weight_bytes": weights,
        "versions": _versions(args.llama_server), "wall_s": time.time() - started,
        "failed_or_short_runs": bad_runs, "rows": rows, "bandwidth_rows": bw_rows,
        "runs": runs})
    print(f"wrote {args.output}")
    if bad_runs:
        sys.exit(f"{bad_runs} runs had failed or short requests: see 'runs' in {args.output}")


if __name__ == "__main__":
    main()
