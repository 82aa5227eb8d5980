"""Where start-up time goes: ``python -X importtime`` of nybble's processes, summed.

Four start-ups, each profiled ``--runs`` times (the run with the median import total is kept):

- ``serve_api``: the API process of ``nybble serve``, from launch to its first answered
  ``POST /v1/completions`` (``-X importtime`` is not passed on to the engine core);
- ``serve_core``: the engine-core process of ``nybble serve`` (default flags), from its spawn to
  its handshake (``PYTHONPROFILEIMPORTTIME=1`` set for it alone);
- ``serve_help``: ``nybble serve --help``;
- ``generate``: ``nybble generate "Once upon a time" --max-tokens 8`` (one process, offline).

Each start-up records the import total, the top-level packages and modules that took longest,
and which heavy or request-specific modules were imported and by whom (see
:mod:`nybble.bench.import_profile`). Usage::

    python benchmarks/startup_imports.py --label before   # then, after a change:
    python benchmarks/startup_imports.py --label after

writes (merging labels) ``benchmarks/results/startup_imports.json``. Import times are inflated
by the profiler itself and by a shared machine's load: compare labels measured close together.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_startup import one_run

from nybble.bench.import_profile import parse_importtime, summarize_imports
from nybble.bench.report import print_table, write_json

_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
# NOTE: the profiler is switched on for the core alone, after this helper's own imports
_CORE_PROBE = """
import asyncio, os
from nybble.cli import build_parser
from nybble.engine_args import engine_config_from_args
from nybble.runtime.frontend.core_client import CoreClient
from nybble.runtime.frontend.core_spawn import spawn_core
config = engine_config_from_args(build_parser(["serve"]).parse_args(["serve"]))
os.environ["PYTHONPROFILEIMPORTTIME"] = "1"
client = CoreClient(spawn_core(config, log_level="WARNING"))
del os.environ["PYTHONPROFILEIMPORTTIME"]
asyncio.run(client.wait_ready())
client.close()
"""


def _stderr_of(cmd: list[str], timeout_s: float) -> list[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_ENV, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.stderr.splitlines()


def profile(which: str, timeout_s: float) -> list[str]:
    """The importtime lines (mixed with other output) of one start-up named ``which``."""
    py = [sys.executable]
    if which == "serve_api":
        log: list[str] = []
        one_run(None, timeout_s, python_flags=("-X", "importtime"), log=log)
        return log
    if which == "serve_core":
        return _stderr_of([*py, "-c", _CORE_PROBE], timeout_s)
    if which == "serve_help":
        return _stderr_of([*py, "-X", "importtime", "-m", "nybble", "serve", "--help"],
                          timeout_s)
    if which == "generate":
        return _stderr_of([*py, "-X", "importtime", "-m", "nybble", "generate",
                           "Once upon a time", "--max-tokens", "8"], timeout_s)
    raise ValueError(f"start-up must be one of {STARTUPS}, got {which!r}")


STARTUPS = ("serve_api", "serve_core", "serve_help", "generate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after", help="key under which results are stored")
    parser.add_argument("--runs", type=int, default=3, help="profiles per start-up")
    parser.add_argument("--only", default=",".join(STARTUPS),
                        help="comma-separated start-ups to profile")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per start-up")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "startup_imports.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {"load_avg_1m_start": os.getloadavg()[0]}
    for which in args.only.split(","):
        runs = [summarize_imports(parse_importtime(profile(which, args.timeout)))
                for _ in range(args.runs)]
        totals = [r["total_s"] for r in runs]
        kept = runs[totals.index(statistics.median_low(totals))]
        results[which] = {**kept, "total_s_runs": totals}
        print_table([{"package": k, "self_s": v} for k, v in kept["by_package"].items()],
                    title=f"{args.label} {which}: {kept['total_s']:.3f} s importing "
                          f"({kept['modules']} modules; runs {totals})")
        print("  imported:", {k: bool(v) for k, v in kept["loaded"].items()})
    results["load_avg_1m_end"] = os.getloadavg()[0]
    previous: dict[str, Any] = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            previous = {k: v for k, v in json.load(f).items() if k != "meta"}
    write_json(args.out, {**previous, "benchmark": "startup_imports", args.label: results})


if __name__ == "__main__":
    main()
