"""Does overlapping the next step's host work with the current forward pay on this CPU?

vLLM's async scheduling prepares step N+1 (schedule, input tensors, attention metadata) while
the model runs step N. In one Python process that work would run on a second thread while the
first thread is in the forward; torch ops release the GIL, but the forward of a small model is
mostly Python between short ops, so the threads contend for the GIL. This probe measures that
directly, per decode step of ``B`` running sequences (bundled model unless ``--model``):

* ``forward``: the model's forward alone (engine A's decode batch, replayed);
* ``host``: the host work of one step on engine B (``schedule``, ``prepare``, the attention
  plan, the sampling rows, ``update``) with no model run;
* ``serial``: ``forward`` then ``host``, one thread;
* ``overlapped``: ``host`` on a second thread while the first runs ``forward``;
* ``gain``: ``1 - overlapped / serial`` (what overlap could save; negative: it costs).

Medians of ``--reps`` alternating rounds of ``--steps`` steps. Run with one torch thread::

    OMP_NUM_THREADS=1 python benchmarks/overlap_probe.py

Prints a table and writes ``benchmarks/results/overlap_probe.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
import numpy as np
import torch
from _report import print_table, write_json

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.kernels.reference.attention import plan_attention
from nybble.runtime.llm_engine import LLMEngine


def _engine(model: str, num_seqs: int) -> LLMEngine:
    """An engine with ``num_seqs`` sequences decoding (long budgets, greedy, no EOS)."""
    engine = LLMEngine.from_engine_args(model, max_num_seqs=num_seqs, disable_log_stats=True)
    rng = np.random.default_rng(num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=470, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [1] + rng.integers(3, engine.vocab_size, 31).tolist(),
                           params)
    for _ in range(3):
        engine.step()
    return engine


def _forward_fn(engine: LLMEngine) -> Callable[[], None]:
    """One decode forward of ``engine``'s next batch, replayed (same slots every time)."""
    core = engine.engine_core
    batch = core.scheduler.schedule()
    assert batch.max_query_len == 1
    runner = core.runner

    def forward() -> None:
        with torch.inference_mode():
            ids, pos, meta = runner.prepare(batch)
            runner.model(ids, pos, runner.kv_caches, meta)
    return forward


def _host_fn(engine: LLMEngine) -> Callable[[], None]:
    """One step's host work on ``engine``: schedule, inputs, plan, sampling rows, update."""
    core = engine.engine_core
    runner, scheduler = core.runner, core.scheduler
    cache = runner.kv_caches[0]

    def host() -> None:
        batch = scheduler.schedule()
        with torch.inference_mode():
            _, _, meta = runner.prepare(batch)
            plan_attention(meta, cache)
        runner.sampling.batch(batch.sample_seq_ids)
        scheduler.update(batch, np.zeros(batch.num_sampled, np.int32))
    return host


def _serial(forward: Callable[[], None], host: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        forward()
        host()
    return (time.perf_counter() - start) / steps


def _overlapped(forward: Callable[[], None], host: Callable[[], None], steps: int) -> float:
    go, done = threading.Semaphore(0), threading.Semaphore(0)

    def helper() -> None:
        for _ in range(steps):
            go.acquire()
            host()
            done.release()
    thread = threading.Thread(target=helper)
    thread.start()
    start = time.perf_counter()
    for _ in range(steps):
        go.release()          # step N+1's host work starts ...
        forward()             # ... while step N's forward runs
        done.acquire()
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed / steps


def _timed(fn: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-seqs", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--reps", type=int, default=7, help="alternating rounds per size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if 3 * args.steps * args.reps > 470:
        ap.error(f"3 * steps * reps must be <= 470 (the sequences' budget), got "
                 f"{3 * args.steps * args.reps}")
    rows = []
    for n in (int(x) for x in args.num_seqs.split(",")):
        forward = _forward_fn(_engine(args.model, n))
        host_engine = _engine(args.model, n)
        host = _host_fn(host_engine)
        times: dict[str, list[float]] = {"forward": [], "host": [], "serial": [],
                                         "overlapped": []}
        for rep in range(args.reps):
            # NOTE: the host engine's sequences advance one token per host call: 3 * steps *
            # reps calls must stay inside their 470-token budget (checked below).
            order = ["serial", "overlapped"] if rep % 2 == 0 else ["overlapped", "serial"]
            times["forward"].append(_timed(forward, args.steps))
            times["host"].append(_timed(host, args.steps))
            for name in order:
                run = _serial if name == "serial" else _overlapped
                times[name].append(run(forward, host, args.steps))
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        rows.append({"num_seqs": n, **{f"{k}_us": v for k, v in med.items()},
                     "gain": 1 - med["overlapped"] / med["serial"]})
    title = (f"overlap probe, {os.path.basename(os.path.normpath(args.model))}, median us "
             f"per step, load {os.getloadavg()[0]:.2f}")
    print_table(rows, title)
    out = os.path.join(_HERE, "results", "overlap_probe.json")
    write_json(out, {"model": args.model, "steps": args.steps, "reps": args.reps,
                     "load_avg_1m": os.getloadavg()[0], "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
