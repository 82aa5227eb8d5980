"""Time from launching ``nybble serve`` to the first answered request (bundled model).

Each run starts ``python -m nybble serve`` as a fresh subprocess on a free loopback port and
records, in seconds since the launch:

- ``url_logged_s``: the server logged its URL (the user sees where to connect);
- ``first_answer_s``: the first ``POST /v1/completions`` (``max_tokens=1``) returned 200,
  polling every 20 ms from the launch;
- ``engine_init_s``: the server's own "engine ready in" figure (from starting the engine-core
  process to its handshake: torch import, weights, KV cache);
- ``cpu_s``: CPU seconds (user + system) both server processes used from launch to exit, a
  figure that depends less on how busy a shared machine is;
- ``api_cpu_at_answer_s``, ``core_cpu_at_answer_s``: CPU seconds of the API process and of the
  engine-core process up to the first answer (Linux ``/proc``);
- ``load_1m``: the 1-minute load average when the run started.

Usage: ``python benchmarks/serve_startup.py [--runs 5] [--model PATH] [--baseline-root DIR]``;
prints a table and writes ``benchmarks/results/serve_startup.json``. With ``--baseline-root``,
the server of another checkout (e.g. main) runs alternately with this one, first in every other
pair, and its runs are recorded as ``baseline``. Target: first answer within 1 s on an idle
machine.
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble.bench.report import print_table, write_json

POLL_S = 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(model: str | None, timeout_s: float, root: str = ROOT,
            python_flags: Sequence[str] = (), log: list[str] | None = None) -> dict[str, float]:
    """Launch, wait for the first answer, shut down; returns the run's timings (seconds).

    ``root`` is the checkout whose ``nybble`` runs (another one for a side-by-side baseline),
    ``python_flags`` go to the server's interpreter (e.g. ``-X importtime``), and ``log``, when
    given, receives the server's output lines.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout_s``.
    """
    port = _free_port()
    cmd = [sys.executable, *python_flags, "-m", "nybble", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", *([model] if model else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    cpu0 = _children_cpu_s()
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    # NOTE: cwd=root: `python -m` puts the working directory first on sys.path
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=root)
    url_logged: list[float] = []
    log = [] if log is None else log

    def read_log() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            log.append(line)
            if not url_logged and f"127.0.0.1:{port}" in line:
                url_logged.append(time.monotonic() - t0)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    body = {"prompt": "Once upon a time", "max_tokens": 1}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{''.join(log)}")
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"no answer within {timeout_s} s:\n{''.join(log)}")
                try:
                    if client.post("/v1/completions", json=body).status_code == 200:
                        first_answer = time.monotonic() - t0
                        api_cpu, core_cpu = _process_cpu_s(proc.pid)
                        break
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    ready = re.search(r"engine ready in ([0-9.]+) s", "".join(log))
    return {"url_logged_s": url_logged[0] if url_logged else float("nan"),
            "first_answer_s": first_answer,
            "engine_init_s": float(ready.group(1)) if ready else float("nan"),
            "cpu_s": _children_cpu_s() - cpu0, "api_cpu_at_answer_s": api_cpu,
            "core_cpu_at_answer_s": core_cpu, "load_1m": load}


def _process_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) so far of process ``pid`` and of its children together
    (Linux ``/proc``; NaN elsewhere)."""
    def cpu(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        return cpu(pid), sum(cpu(c) for c in children)
    except OSError:
        return float("nan"), float("nan")


def _children_cpu_s() -> float:
    """User + system CPU seconds of the waited-for child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    firsts = [r["first_answer_s"] for r in rows]
    return {"median_first_answer_s": statistics.median(firsts),
            "min_first_answer_s": min(firsts), "max_first_answer_s": max(firsts),
            "median_cpu_s": statistics.median(r["cpu_s"] for r in rows),
            "median_api_cpu_at_answer_s": statistics.median(r["api_cpu_at_answer_s"]
                                                            for r in rows),
            "median_core_cpu_at_answer_s": statistics.median(r["core_cpu_at_answer_s"]
                                                             for r in rows),
            "median_load_1m": statistics.median(r["load_1m"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="number of cold starts")
    parser.add_argument("--model", default=None, help="model folder (default: bundled)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--baseline-root", default=None,
                        help="another checkout (e.g. `git worktree add /tmp/base main`, built) "
                             "whose server runs alternately with this one, as `baseline`")
    parser.add_argument("--baseline-what", default="", help="what the baseline is (recorded)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "serve_startup.json"))
    args = parser.parse_args()
    rows, base_rows = [], []
    for i in range(args.runs):
        # NOTE: alternate which side goes first, so a drift in the machine's load hits both
        order = [False, True] if i % 2 else [True, False]
        for is_base in order if args.baseline_root else [False]:
            root = args.baseline_root if is_base else ROOT
            (base_rows if is_base else rows).append(
                {"run": i, **one_run(args.model, args.timeout, root=root)})
    summary = {**_summary(rows), "target_s": 1.0}
    print_table(rows, title="nybble serve: launch -> first answered request (seconds)")
    print_table([summary])
    payload = {"benchmark": "serve_startup", "model": args.model or "bundled", "runs": rows,
               "summary": summary}
    if args.baseline_root:
        payload["baseline"] = {"what": args.baseline_what, "runs": base_rows,
                               "summary": _summary(base_rows)}
        print_table(base_rows, title=f"baseline: {args.baseline_what or args.baseline_root}")
        print_table([payload["baseline"]["summary"]])
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
