"""Step-time cost of each logit-shaping feature, unused and used by half the batch.

Setup: an in-process engine with ``--batch`` requests decoding together (greedy,
``ignore_eos``, prompts of a few tokens), timed over ``--steps`` decode steps after warm-up
(one ``LLMEngine.step()`` each: schedule, forward, shaping, sampling, update, outputs).

- **unused**: the step as shipped (the runner checks ``len(shaping)`` twice) against the same
  step with those two checks removed (the runner's ``execute`` before logit shaping existed,
  rebuilt here); no request shapes. Goal: no measurable difference.
- **half the batch**: every other request uses the feature (``logit_bias`` on 50 ids,
  ``min_tokens`` past the window, ``repetition_penalty``, presence + frequency penalties,
  two ``bad_words``, 100 ``allowed_token_ids``, a ``guided_regex`` grammar that stays open
  for the whole window), against the plain batch.

Times are CPU time of the process (one intra-op thread): on a shared machine the wall clock
mostly measures the other tenants. ``shaping_cpu_ms`` is the part spent in the runner's
``LogitShaping.apply`` and ``accept`` (grammar bitmasks included); in the unused row it is
the two ``len`` checks, timed directly. Every cell is the median of ``--repeats`` runs, the
configurations alternating run by run (A B, then B A, ...). Run: ``OMP_NUM_THREADS=1 python benchmarks/logit_shaping.py
[--model stories260k] [--batch 32] [--steps 100] [--repeats 5]``; prints a table and writes
``benchmarks/results/logit_shaping.json`` (with the load average before and after).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
from _report import machine_meta, print_table, write_json
from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.runtime.worker import model_runner
from nybble.runtime.llm_engine import LLMEngine
from nybble.sampling_params import GuidedDecodingParams

PROMPTS = ["Once upon a time", "The dog", "Lily and Tom", "One day, a little bird"]
FEATURES: dict[str, dict[str, Any]] = {
    "logit_bias": dict(logit_bias={i: (-1.0) ** i * 2.0 for i in range(100, 150)}),
    "min_tokens": dict(min_tokens=-1),   # -1: the whole budget (set per run)
    "repetition_penalty": dict(repetition_penalty=1.2),
    "presence+frequency": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "bad_words": dict(bad_words=["the", "was happy"]),
    "allowed_token_ids": dict(allowed_token_ids=list(range(3, 103))),
    # NOTE: the model never writes the capitals, so the grammar stays open all window (a
    # counted repeat such as {3000,} would, but xgrammar then spends ~0.2 ms per token)
    "guided_regex": dict(guided_decoding=GuidedDecodingParams(regex="[a-z ]+QZQ")),
}


def _execute_without_shaping(self: model_runner.ModelRunner, batch: Any) -> Any:
    """``ModelRunner.execute`` without the two shaping checks (the step before the feature)."""
    if len(batch.copy_src):
        self._copy_blocks(batch.copy_src, batch.copy_dst)
    input_ids, positions, meta = self.prepare(batch)
    hidden = self.model(input_ids, positions, self.kv_caches, meta)
    logits = self.model.compute_logits(self._sampled_hidden(hidden, batch))
    out = model_runner.sample(logits, self.sampling.batch(batch.sample_seq_ids),
                              self.generator)
    host = model_runner._host
    return model_runner.ModelRunnerOutput(
        token_ids=host(out.token_ids).astype(np.int32), logprobs=host(out.logprobs),
        top_token_ids=host(out.top_ids), top_logprobs=host(out.top_logprobs),
        grammar_ended=[])


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        t0 = time.process_time()
        try:
            return fn(*args)
        finally:
            spent[0] += time.process_time() - t0
    return wrapper


def time_steps(model: str, batch: int, steps: int, extra: dict[str, Any] | None,
               hooks: bool = True) -> tuple[float, float]:
    """``(CPU ms per decode step, of which CPU ms in logit shaping)``; ``extra``: sampling
    fields for every other request.

    NOTE: CPU time of this process (one intra-op thread), not wall time: on a shared machine
    the wall clock mostly measures the other tenants.
    """
    engine = LLMEngine.from_engine_args(model, max_num_seqs=batch)
    runner = engine.engine_core.runner
    if not hooks:
        runner.execute = _execute_without_shaping.__get__(runner)
    spent = [0.0]
    runner.shaping.apply = _timed(runner.shaping.apply, spent)
    runner.shaping.accept = _timed(runner.shaping.accept, spent)
    for i in range(batch):
        kw = dict(extra or {}) if i % 2 == 0 else {}
        if kw.get("min_tokens") == -1:
            kw["min_tokens"] = steps + 8
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)],
                           SamplingParams(temperature=0.0, ignore_eos=True,
                                          max_tokens=steps + 8, **kw))
    for _ in range(4):       # prefill and a few decode steps
        engine.step()
    spent[0] = 0.0
    t0 = time.process_time()
    for _ in range(steps):
        engine.step()
    elapsed = (time.process_time() - t0) / steps * 1e3
    running = engine.get_stats().num_running
    if running != batch:
        raise RuntimeError(f"every request must still run in the window, got {running} of "
                           f"{batch}")
    return elapsed, spent[0] / steps * 1e3


def _alternate(configs: dict[str, Callable[[], tuple[float, float]]],
               repeats: int) -> dict[str, list[tuple[float, float]]]:
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for r in range(repeats):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        for name in order:
            runs[name].append(configs[name]())
    return runs


def _hook_cost_ms(number: int = 200_000) -> float:
    """CPU ms per step of what an unshaped step adds: the runner's two ``len(shaping)``
    checks on an empty table (timed directly; the whole-step A/B above cannot resolve it)."""
    shaping = LLMEngine.from_engine_args(DEFAULT_MODEL, max_num_seqs=1).engine_core.runner.shaping
    t0 = time.process_time()
    for _ in range(number):
        if len(shaping):
            raise AssertionError("the table must be empty")
        if len(shaping):
            raise AssertionError("the table must be empty")
    return (time.process_time() - t0) / number * 1e3


def _row(feature: str, rows_using: int, used: list[tuple[float, float]],
         base: list[tuple[float, float]]) -> dict[str, Any]:
    step = statistics.median(u for u, _ in used)
    plain = statistics.median(b for b, _ in base)
    return {"feature": feature, "rows_using": rows_using, "cpu_ms_per_step": step,
            "baseline_cpu_ms": plain, "overhead_pct": 100 * (step / plain - 1),
            "shaping_cpu_ms": statistics.median(s for _, s in used),
            "runs": used, "baseline_runs": base}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns the payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(_HERE, "results", "logit_shaping.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    m, b, s = args.model, args.batch, args.steps
    unused = _alternate({"hooks": lambda: time_steps(m, b, s, None),
                         "no_hooks": lambda: time_steps(m, b, s, None, hooks=False)},
                        args.repeats)
    rows = [_row("(none): as shipped vs without the hooks", 0, unused["hooks"],
                 unused["no_hooks"])]
    rows[0]["shaping_cpu_ms"] = _hook_cost_ms()
    for name, extra in FEATURES.items():
        runs = _alternate({"plain": lambda: time_steps(m, b, s, None),
                           name: lambda extra=extra: time_steps(m, b, s, extra)}, args.repeats)
        rows.append(_row(name, b // 2 + b % 2, runs[name], runs["plain"]))
    print_table([{k: v for k, v in r.items() if not k.endswith("runs")} for r in rows],
                title=f"logit shaping: CPU ms per decode step, batch {b}, "
                      f"{os.path.basename(m)} (median of {args.repeats}, alternating)")
    payload = {"model": m, "batch": b, "steps": s, "repeats": args.repeats, "rows": rows,
               "load_before": load_before, "load_after": os.getloadavg(),
               "machine": machine_meta()}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
