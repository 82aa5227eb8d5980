"""``nybble bench serve``: online serving latency and throughput against an OpenAI server.

Targets ``--base-url`` or starts ``nybble serve`` itself (a subprocess on a free loopback port,
given the ``--serve-args`` flags, stopped at the end). For each ``--request-rate`` (a
comma-separated sweep; ``inf`` = all at once) the same seeded request set is sent by
:mod:`nybble.bench.serve_client`; one table row per rate.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from nybble.bench.models import model_max_len, model_vocab_size, resolve_model
from nybble.bench.report import print_table, write_json
from nybble.bench.serve_client import aggregate, run_load
from nybble.bench.workloads import WorkloadConfig, build_requests, describe


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything one ``bench serve`` invocation needs.

    Attributes:
        model: model folder (tokenizer for the prompts; served model when launching).
        base_url: server to target; ``None``: launch ``nybble serve`` on a free port.
        serve_args: extra ``nybble serve`` flags when launching.
        request_rates: requests per second, one run each (``inf``: all at t = 0).
        max_concurrency: most requests in flight (``None``: unlimited).
        workload: the request set (the same set for every rate).
        server_timeout_s: seconds to wait for a launched server to answer.
        api_key: bearer token, if the server wants one.
        output: JSON path or ``None``.
    """

    model: str
    base_url: str | None = None
    serve_args: tuple[str, ...] = ()
    request_rates: tuple[float, ...] = (float("inf"),)
    max_concurrency: int | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    server_timeout_s: float = 300.0
    api_key: str | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        if any(r <= 0 for r in self.request_rates):
            raise ValueError(f"request rates must be > 0, got {self.request_rates}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def launched_server(model: str, serve_args: tuple[str, ...],
                    timeout_s: float) -> Iterator[str]:
    """Run ``nybble serve`` on a free loopback port; yields its base URL, stops it after.

    Raises:
        RuntimeError: the server exited or did not answer ``/v1/models`` within ``timeout_s``;
            the message carries the tail of its log.
    """
    with launched_server_process(model, serve_args, timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def launched_server_process(model: str, serve_args: tuple[str, ...],
                            timeout_s: float) -> Iterator[tuple[str, int]]:
    """:func:`launched_server`, yielding ``(base URL, process id of the API process)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "nybble", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), *serve_args]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="nybble-bench-serve-") as tmp:
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_ready(proc, url, log_path, timeout_s)
                yield url, proc.pid
            finally:
                stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it has not exited after ``timeout_s`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: str,
                timeout_s: float) -> None:
    """Poll ``/v1/models`` until the server answers; raise with its log tail otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"nybble serve exited with {proc.returncode}: {_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/v1/models", timeout=2.0).status_code < 500:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nybble serve did not answer within {timeout_s:.0f}s: "
                               f"{_tail(log_path)}")
        time.sleep(0.5)


def _tail(path: str, n: int = 2000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def served_model_name(base_url: str, api_key: str | None) -> str:
    """The first model id ``/v1/models`` lists.

    Raises:
        ConnectionError: the server cannot be reached or does not answer with a model list
            (one line for the user, naming the URL).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=30.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ConnectionError(f"cannot use the server at {base_url}: GET {url} failed: "
                              f"{type(e).__name__}: {e}") from None


def _row(rate: float, res: dict[str, Any]) -> dict[str, Any]:
    return {"rate": rate, "done": res["completed"], "fail": res["failed"],
            "dur_s": res["duration_s"], "req/s": res["request_throughput"],
            "out_tok/s": res["output_throughput"], "tot_tok/s": res["total_token_throughput"],
            "ttft_p50": res["ttft_median_ms"], "ttft_p90": res["ttft_p90_ms"],
            "ttft_p99": res["ttft_p99_ms"], "tpot_p50": res["tpot_median_ms"],
            "tpot_p90": res["tpot_p90_ms"], "tpot_p99": res["tpot_p99_ms"],
            "itl_p50": res["itl_median_ms"], "itl_p99": res["itl_p99_ms"],
            "e2el_p50": res["e2el_median_ms"], "e2el_p99": res["e2el_p99_ms"]}


def run_serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run every rate, print the table (latencies in ms), write JSON; returns the payload."""
    from transformers import AutoTokenizer

    # NOTE: httpx logs every request at INFO: thousands of lines between the tables
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if cfg.base_url is not None:  # NOTE: fail in a second with one line, before the tokenizer
        served_model_name(cfg.base_url, cfg.api_key)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    requests = build_requests(cfg.workload, tokenizer, model_vocab_size(cfg.model))
    with contextlib.ExitStack() as stack:
        url = cfg.base_url or stack.enter_context(
            launched_server(cfg.model, cfg.serve_args, cfg.server_timeout_s))
        name = served_model_name(url, cfg.api_key)
        runs = []
        for rate in cfg.request_rates:
            records, duration = asyncio.run(run_load(url, name, requests, rate,
                                                     cfg.max_concurrency, cfg.workload.seed,
                                                     cfg.api_key))
            runs.append({"request_rate": rate, "max_concurrency": cfg.max_concurrency,
                         **aggregate(records, duration)})
    print_table([_row(r["request_rate"], r) for r in runs],
                title=f"nybble bench serve: {name} ({len(requests)} requests, "
                      f"max concurrency {cfg.max_concurrency or 'unlimited'}; latencies in ms)")
    payload = {"benchmark": "serve", "model": cfg.model, "served_model": name,
               "config": dataclasses.asdict(cfg), "workload": describe(requests), "runs": runs}
    if cfg.output:
        write_json(cfg.output, payload)
    return payload


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench serve`` (besides the shared workload flags)."""
    parser.add_argument("--model", default=None,
                        help="model folder or stories260k / llama-random (tokenizer of the "
                             "prompts; served model when launching); default: stories260k")
    parser.add_argument("--base-url", default=None,
                        help="target this server, e.g. http://127.0.0.1:8000 (default: launch "
                             "nybble serve on a free loopback port)")
    parser.add_argument("--serve-args", default="",
                        help="extra flags for the launched nybble serve, one quoted string")
    parser.add_argument("--num-prompts", "--num-requests", dest="num_prompts", type=int,
                        default=100, help="requests per rate")
    parser.add_argument("--request-rate", default="inf",
                        help="requests/s of the Poisson arrivals; comma-separated for a sweep; "
                             "inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: unlimited)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the server's max_model_len, bounding prompt + output (default: "
                             "the model's max_position_embeddings)")
    parser.add_argument("--server-timeout", type=float, default=300.0,
                        help="seconds to wait for the launched server")
    parser.add_argument("--api-key", default=os.environ.get("NYBBLE_API_KEY"))
    parser.add_argument("--output", "-o", default=None, help="write the results as JSON here")


def serve_config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """Build the :class:`ServeBenchConfig` from parsed flags."""
    from nybble.bench.throughput import workload_from_args

    model = resolve_model(args.model)
    serve_args = tuple(shlex.split(args.serve_args))
    if args.max_model_len and "--max-model-len" not in serve_args:
        serve_args += ("--max-model-len", str(args.max_model_len))
    rates = tuple(float(r) for r in args.request_rate.split(","))
    args.max_model_len = args.max_model_len or model_max_len(model)
    return ServeBenchConfig(model=model, base_url=args.base_url, serve_args=serve_args,
                            request_rates=rates, max_concurrency=args.max_concurrency,
                            workload=workload_from_args(args, model, args.num_prompts),
                            server_timeout_s=args.server_timeout, api_key=args.api_key,
                            output=args.output)
