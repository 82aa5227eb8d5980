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

Every cell is the median of ``--repeats`` runs, the configurations alternating run by run
(A B ... then reversed). Run: ``OMP_NUM_THREADS=1 python benchmarks/logit_shaping.py
[--model stories260k] [--batch 32] [--steps 40] [--repeats 3]``; prints a table and writes
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
from nybble.runtime import model_runner
from nybble.runtime.engine import LLMEngine
from nybble.sampling_params import GuidedDecodingParams

PROMPTS = ["Once upon a time", "The dog", "Lily and Tom", "One day, a little bird"]
FEATURES: dict[str, dict[str, Any]] = {
    "logit_bias": dict(logit_bias={i: (-1.0) ** i * 2.0 for i in range(100, 150)}),
    "min_tokens": dict(min_tokens=400),
    "repetition_penalty": dict(repetition_penalty=1.2),
    "presence+frequency": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "bad_words": dict(bad_words=["the", "was happy"]),
    "allowed_token_ids": dict(allowed_token_ids=list(range(3, 103))),
    "guided_regex": dict(guided_decoding=GuidedDecodingParams(regex="[a-z ]{1,2000}")),
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


def time_steps(model: str, batch: int, steps: int, extra: dict[str, Any] | None,
               hooks: bool = True) -> float:
    """Milliseconds per decode step; ``extra`` sampling fields for every other request."""
    engine = LLMEngine.from_engine_args(model, max_num_seqs=batch)
    if not hooks:
        engine.engine_core.runner.execute = _execute_without_shaping.__get__(
            engine.engine_core.runner)
    for i in range(batch):
        kw = dict(extra or {}) if i % 2 == 0 else {}
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)],
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400,
                                          **kw))
    for _ in range(4):       # prefill and a few decode steps
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - t0) / steps * 1e3
    running = engine.get_stats().num_running
    if running != batch:
        raise RuntimeError(f"every request must still run in the window, got {running} of "
                           f"{batch}")
    return elapsed


def _alternate(configs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(repeats):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        for name in order:
            runs[name].append(configs[name]())
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns the payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(_HERE, "results", "logit_shaping.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    m, b, s = args.model, args.batch, args.steps
    unused = _alternate({"hooks": lambda: time_steps(m, b, s, None),
                         "no_hooks": lambda: time_steps(m, b, s, None, hooks=False)},
                        args.repeats)
    base = statistics.median(unused["no_hooks"])
    rows = [{"feature": "(none) step as shipped vs without the hooks", "rows_using": 0,
             "ms_per_step": statistics.median(unused["hooks"]), "baseline_ms": base,
             "overhead_pct": 100 * (statistics.median(unused["hooks"]) / base - 1),
             "runs_ms": unused["hooks"], "baseline_runs_ms": unused["no_hooks"]}]
    for name, extra in FEATURES.items():
        runs = _alternate({"plain": lambda: time_steps(m, b, s, None),
                           name: lambda extra=extra: time_steps(m, b, s, extra)}, args.repeats)
        plain, used = statistics.median(runs["plain"]), statistics.median(runs[name])
        rows.append({"feature": name, "rows_using": b // 2 + b % 2, "ms_per_step": used,
                     "baseline_ms": plain, "overhead_pct": 100 * (used / plain - 1),
                     "runs_ms": runs[name], "baseline_runs_ms": runs["plain"]})
    print_table([{k: v for k, v in r.items() if not k.endswith("runs_ms")} for r in rows],
                title=f"logit shaping: ms per decode step, batch {b}, {os.path.basename(m)} "
                      f"(median of {args.repeats}, alternating)")
    payload = {"model": m, "batch": b, "steps": s, "repeats": args.repeats, "rows": rows,
               "load_before": load_before, "load_after": os.getloadavg(),
               "machine": machine_meta()}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
