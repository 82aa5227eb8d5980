"""Host overhead of one scheduler step (schedule + update + block bookkeeping + output arrays).

Measures microseconds per step with 32, 256 and 1024 running decode sequences, for the Cython
``Scheduler`` and for ``ReferenceScheduler``, the plain-Python reference of the same rule
(``nybble/runtime/scheduler/reference_scheduler.py``, the tests' oracle: same batches, same block
ids).
No model runs: sampled tokens are a constant. CPU only, no torch. The two are timed in
alternating runs (A B, B A, ...) and each cell is the median of ``--repeats`` runs.

Run: ``python benchmarks/scheduler_overhead.py [--steps 200] [--repeats 3]``; prints a table
and writes ``benchmarks/results/scheduler_overhead.json`` (with the load average).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
from _report import print_table, write_json
from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler
from nybble.runtime.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_LEN = 128
MAX_MODEL_LEN = 2048
IMPLS = {"cython": Scheduler, "python": ReferenceScheduler}


def _warm_to_decode(sched: Any, num_seqs: int) -> None:
    """Add ``num_seqs`` requests and step until every one of them is decoding."""
    for i in range(num_seqs):
        sched.add(i, list(range(PROMPT_LEN)), MAX_MODEL_LEN, (MAX_MODEL_LEN + 7,))
    for _ in range(10_000):
        batch = sched.schedule()
        sched.update(batch, np.full(batch.num_sampled, 5, np.int32))
        if batch.num_tokens == num_seqs and batch.num_sampled == num_seqs:
            return
    raise RuntimeError(f"`num_seqs` must reach steady decode, got stuck at {num_seqs}")


def time_steps(impl: type, num_seqs: int, steps: int) -> float:
    """Microseconds per decode step with ``num_seqs`` running, one fresh scheduler."""
    blocks = num_seqs * (-(-MAX_MODEL_LEN // BLOCK_SIZE)) // 4 + 64
    sched = impl(blocks, BLOCK_SIZE, num_seqs, max(2048, num_seqs), MAX_MODEL_LEN)
    _warm_to_decode(sched, num_seqs)
    sampled = np.full(num_seqs, 5, np.int32)
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.update(sched.schedule(), sampled)
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns the payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "scheduler_overhead.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for n in (32, 256, 1024):
        runs: dict[str, list[float]] = {name: [] for name in IMPLS}
        for r in range(args.repeats):
            order = list(IMPLS) if r % 2 == 0 else list(IMPLS)[::-1]   # A B, B A, ...
            for name in order:
                runs[name].append(time_steps(IMPLS[name], n, args.steps))
        cy, py = statistics.median(runs["cython"]), statistics.median(runs["python"])
        rows.append({"running_seqs": n, "cython_us_per_step": cy, "python_us_per_step": py,
                     "cython_us_per_seq": cy / n, "speedup": py / cy,
                     "cython_runs_us": runs["cython"], "python_runs_us": runs["python"]})
    print_table([{k: v for k, v in row.items() if not k.endswith("_runs_us")} for row in rows],
                title="scheduler step overhead (decode, block_size 16, CPU; median of "
                      f"{args.repeats} alternating runs)")
    payload = {"benchmark": "scheduler_overhead", "steps": args.steps,
               "repeats": args.repeats, "block_size": BLOCK_SIZE, "prompt_len": PROMPT_LEN,
               "python_impl": "nybble.runtime.scheduler.reference_scheduler.ReferenceScheduler",
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
