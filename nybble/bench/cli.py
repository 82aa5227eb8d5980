"""``nybble bench throughput | serve``: registered into the ``nybble`` command."""
from __future__ import annotations

import argparse
from typing import Any


def _throughput(args: argparse.Namespace) -> int:
    from nybble.bench.models import MODEL_ALIASES
    from nybble.model_files import check_model_dir

    if args.model is not None and args.model not in MODEL_ALIASES:
        check_model_dir(args.model)  # NOTE: a bad path answers before torch is imported
    from nybble.runtime.worker.torch_threads import setup_threads

    # NOTE: before torch is imported; --threads (an engine flag) applies to both backends
    args.threads = setup_threads(args.threads)
    from nybble.bench.throughput import run_throughput, throughput_config_from_args

    run_throughput(throughput_config_from_args(args))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from nybble.bench.serve import run_serve_bench, serve_config_from_args

    payload = run_serve_bench(serve_config_from_args(args))
    return 1 if any(r["failed"] for r in payload["runs"]) else 0


def register(subparsers: Any) -> None:
    """Add ``bench`` with its ``throughput`` and ``serve`` subcommands to ``subparsers``."""
    from nybble.bench.serve import add_serve_bench_args
    from nybble.bench.throughput import add_throughput_args, add_workload_args
    from nybble.engine_args import add_engine_args

    bench = subparsers.add_parser("bench", help="benchmark throughput or serving latency")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    tp = sub.add_parser(
        "throughput", help="offline throughput: nybble LLM vs Hugging Face static batching",
        description="Run N requests through nybble's LLM and Hugging Face generate (static "
                    "batches of --max-num-seqs) in one process; print a table, write JSON. "
                    "--model also takes stories260k or llama-random.")
    add_engine_args(tp, lora=False)
    add_throughput_args(tp)
    tp.set_defaults(func=_throughput)
    sv = sub.add_parser(
        "serve", help="online latency: Poisson load on /v1/completions (streaming)",
        description="Send streaming /v1/completions requests at Poisson --request-rate to "
                    "--base-url or a launched nybble serve; report TTFT, TPOT, ITL, e2e.")
    add_serve_bench_args(sv)
    add_workload_args(sv)
    sv.set_defaults(func=_serve)
