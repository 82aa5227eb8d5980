"""Where one decode step's time goes: schedule / prepare / forward / sample / output.

Runs the engine core (bundled model unless ``--model``) with 1, 16 and 64 running decode
sequences (greedy, ``ignore_eos``) and times every phase of :meth:`EngineCore.step` on the
real code path, by wrapping the phase functions on the instance (nothing else changes):

* ``schedule``: ``Scheduler.schedule()`` (Cython);
* ``prepare``: the rest of ``ModelRunner.execute`` (step inputs, metadata, sampling rows,
  result arrays): ``execute`` minus forward minus sample;
* ``forward``: the model's ``forward`` (embedding, decoder layers, final norm; on CUDA a
  replayed decode graph counts in ``prepare``: ``--engine-args enforce_eager=1`` separates it);
* ``sample``: ``compute_logits`` plus the sampler;
* ``output``: the rest of ``EngineCore.step`` (``Scheduler.update``, the output message);
* ``detok``: the output processor (``LLMEngine.step`` minus ``EngineCore.step``);
* ``step``: the whole ``LLMEngine.step``.

All times are microseconds per step, the median over ``--steps`` decode steps after the
prompts are in the cache (on CUDA each phase ends with a device sync), of elapsed time or, with
``--clock cpu``, of the process's CPU time (on a busy shared machine, time spent waiting for a
core inflates the first and not the second). A second, shorter pass under ``torch.profiler`` counts the aten ops
one step dispatches (``ops``). Run with one torch thread::

    OMP_NUM_THREADS=1 python benchmarks/step_breakdown.py [--label after] [--steps 200]

Prints a table and writes ``benchmarks/results/step_breakdown[-LABEL].json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
import numpy as np
import torch
from _report import print_table, write_json

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.runtime.worker import model_runner as model_runner_module
from nybble.runtime.llm_engine import LLMEngine

WARMUP_STEPS = 4
PHASES = ("schedule", "prepare", "forward", "sample", "output", "detok", "step")


class _Timer:
    """Accumulates the seconds spent in wrapped callables during one step, by phase; on CUDA
    each phase ends with a device sync, so its kernels count in it."""

    def __init__(self, sync: Callable[[], None] | None, clock: Callable[[], float]) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.sync = sync
        self.clock = clock

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self.spent[phase] += self.clock() - start
        return timed


class _SchedulerProxy:
    """Stands in for the Cython scheduler: times ``schedule``/``update``, forwards the rest."""

    def __init__(self, scheduler: Any, timer: _Timer) -> None:
        object.__setattr__(self, "_inner", scheduler)
        object.__setattr__(self, "schedule", timer.wrap("schedule", scheduler.schedule))
        object.__setattr__(self, "update", timer.wrap("update", scheduler.update))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def instrument(engine: LLMEngine, clock: Callable[[], float]
               ) -> tuple[_Timer, Callable[[], None]]:
    """Wrap the phase functions of ``engine`` (instance attributes only); returns the timer
    and a function that undoes the wrapping."""
    core = engine.engine_core
    timer = _Timer(torch.cuda.synchronize if core.device.type == "cuda" else None, clock)
    runner, model = core.runner, core.runner.model
    original_sample = model_runner_module.sample
    core.scheduler = _SchedulerProxy(core.scheduler, timer)
    runner.execute = timer.wrap("execute", runner.execute)
    model.forward = timer.wrap("forward", model.forward)
    model.compute_logits = timer.wrap("sample", model.compute_logits)
    model_runner_module.sample = timer.wrap("sample", original_sample)
    core.step = timer.wrap("core", core.step)

    def undo() -> None:
        core.scheduler = core.scheduler._inner
        for obj, name in ((runner, "execute"), (model, "forward"), (model, "compute_logits"),
                          (core, "step")):
            del obj.__dict__[name]
        model_runner_module.sample = original_sample
    return timer, undo


def _phases(spent: dict[str, float], total: float) -> dict[str, float]:
    """Microseconds per phase from one step's raw wrapper times (seconds)."""
    us = {k: v * 1e6 for k, v in spent.items()}
    return {"schedule": us["schedule"],
            "prepare": us["execute"] - us["forward"] - us["sample"],
            "forward": us["forward"], "sample": us["sample"],
            "output": us["core"] - us["schedule"] - us["execute"],
            "detok": total * 1e6 - us["core"], "step": total * 1e6}


def _start(engine: LLMEngine, num_seqs: int, prompt_len: int, max_tokens: int,
           seed: int) -> None:
    """Add ``num_seqs`` greedy requests and step until every prompt is prefilled."""
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [1] + rng.integers(3, vocab, prompt_len - 1).tolist()
        engine.add_request(f"r{i}", prompt, params)
    while engine.scheduler.num_waiting or engine.get_stats().num_steps == 0:
        engine.step()
    engine.step()   # the first decode step of the last admitted prompts


def measure(engine: LLMEngine, num_seqs: int, steps: int, prompt_len: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Median microseconds per phase over ``steps`` decode steps of ``num_seqs`` sequences."""
    _start(engine, num_seqs, prompt_len, steps + 16, seed=num_seqs)
    assert engine.scheduler.num_running == num_seqs, "every sequence must be decoding"
    for _ in range(WARMUP_STEPS):   # compiled segments / graphs see this shape once first
        engine.step()
    timer, undo = instrument(engine, clock)
    rows: list[dict[str, float]] = []
    try:
        for _ in range(steps):
            timer.spent.clear()
            start = clock()
            engine.step()
            rows.append(_phases(timer.spent, clock() - start))
    finally:
        undo()
    ops = count_ops(engine, 3)
    engine.abort_request([f"r{i}" for i in range(num_seqs)])
    result: dict[str, Any] = {"num_seqs": num_seqs}
    result.update({p: statistics.median(r[p] for r in rows) for p in PHASES})
    result["us_per_token"] = result["step"] / num_seqs
    result["ops"] = ops
    return result


def _is_top_level_aten(event: Any) -> bool:
    """An aten op called from Python (not one that another aten op dispatched)."""
    parent = event.cpu_parent
    return event.name.startswith("aten::") and (parent is None
                                                or not parent.name.startswith("aten::"))


def count_ops(engine: LLMEngine, steps: int) -> int:
    """aten ops dispatched per step (median of ``steps`` profiled steps)."""
    counts = []
    for _ in range(steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step()
        counts.append(sum(1 for e in prof.events() if _is_top_level_aten(e)))
    return int(statistics.median(counts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-seqs", default="1,16,64", help="comma-separated running sequences")
    ap.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--label", default="", help="suffix of the JSON file name")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (what a busy shared "
                         "machine's waiting for a core does not inflate)")
    ap.add_argument("--engine-args", default="",
                    help="extra engine kwargs, e.g. 'compilation_level=0,max_model_len=512'")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(x) for x in args.num_seqs.split(",")]
    extra: dict[str, Any] = {}
    for item in filter(None, args.engine_args.split(",")):
        key, _, value = item.partition("=")
        extra[key] = int(value) if value.lstrip("-").isdigit() else value
    engine = LLMEngine.from_engine_args(args.model, max_num_seqs=max(sizes),
                                        disable_log_stats=True, **extra)
    rows = [measure(engine, n, args.steps, args.prompt_len, CLOCKS[args.clock]) for n in sizes]
    title = (f"decode step breakdown, {os.path.basename(os.path.normpath(args.model))}, "
             f"median {args.clock} us/step over {args.steps} steps, torch threads "
             f"{torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print_table(rows, title)
    suffix = f"-{args.label}" if args.label else ""
    out = args.output or os.path.join(_HERE, "results", f"step_breakdown{suffix}.json")
    write_json(out, {"model": args.model, "steps": args.steps, "prompt_len": args.prompt_len,
                     "clock": args.clock,
                     "engine_args": extra, "load_avg_1m": os.getloadavg()[0], "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
