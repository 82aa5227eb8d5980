"""Does a seeded request sample the same tokens alone and batched with 7-15 greedy requests?

The sampler draws a seeded request's noise from the request's own generator, so the random
numbers do not depend on the batch (``tests/runtime/sample/test_sampling.py`` checks that). The
probabilities they are compared with come from the model's forward pass, whose float32
results may differ in the last bits with the batch's size and composition (different GEMM
shapes, different reduction orders). This script measures both effects on the engine as it is:

- per trial, a seeded request (``temperature`` 0.8, its own ``seed``) runs alone, then again
  batched with ``k`` greedy requests (``k`` uniform in 7..15, random prompts and lengths),
  which arrive either all together with it, or staggered (one every 3 steps around it, so
  its decode steps also share batches with prefills, as on a server);
  the trial counts as *changed* when the seeded request's tokens differ, and records where
  they first differ;
- for every step both runs share (same tokens so far), the largest absolute difference
  between the seeded row's logits alone and batched, and the smallest gap between the two
  best scores ``p_i / E_i`` of the race the sampler runs (a near-tie flips when the logits
  move by about that much).

Usage: ``python benchmarks/seed_batch_invariance.py [--trials 20] [--models stories260k,
PATH]``; prints a table and writes ``benchmarks/results/seed_batch_invariance.json``. Run it
with ``OMP_NUM_THREADS=1`` (and again with more threads: the GEMM kernels change with them).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble import SamplingParams
from nybble.bench.report import print_table, write_json
from nybble.config import DEFAULT_MODEL
from nybble.runtime.worker import model_runner
from nybble.runtime.llm_engine import LLMEngine

STARTS = ["Once upon a time", "The dog", "Lily and Tom went to the park", "One day, a bird",
          "The little girl saw a big red ball", "Tim was sad because", "In the forest",
          "Sue had a cat named", "The sun was hot and", "Mom said"]


class LogitTap:
    """Records the logits row of one sequence id at every step (wraps the runner's sampler)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.runner = engine.engine_core.runner
        self.seq_id = -1
        self.rows: list[np.ndarray] = []
        self._ids: np.ndarray | None = None
        execute, sample = self.runner.execute, model_runner.sample

        def tapped_execute(batch: Any) -> Any:
            self._ids = batch.sample_seq_ids.copy()
            return execute(batch)

        def tapped_sample(logits: torch.Tensor, *args: Any) -> Any:
            hit = np.flatnonzero(self._ids == self.seq_id)
            if hit.size:
                self.rows.append(logits[int(hit[0])].float().cpu().numpy().copy())
            return sample(logits, *args)

        self.runner.execute = tapped_execute
        model_runner.sample = tapped_sample


def _run(engine: LLMEngine, tap: LogitTap,
         arrivals: list[tuple[int, str, str, SamplingParams]],
         seeded: str) -> tuple[list[int], list[np.ndarray]]:
    """Add each request ``(step, id, prompt, params)`` before that step; run to the end."""
    pending = sorted(arrivals, key=lambda a: a[0])
    tap.seq_id = -1
    tokens: list[int] = []
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
            if rid == seeded:
                tap.seq_id, tap.rows = engine.engine_core.seq_ids(seeded)[0], []
        for out in engine.step():
            if out.request_id == seeded and out.finished:
                tokens = list(out.outputs[0].token_ids)
        step += 1
    return tokens, tap.rows


def _race_gap(logits: np.ndarray, temperature: float, noise: np.ndarray) -> float:
    """Relative gap between the two best ``p / E`` scores (0: an exact tie)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    score = np.sort(p / noise)[::-1]
    return float((score[0] - score[1]) / score[0])


def trial(engine: LLMEngine, tap: LogitTap, t: int, temperature: float,
          max_tokens: int, staggered: bool) -> dict[str, Any]:
    rng = random.Random(t)
    prompt = rng.choice(STARTS)
    params = SamplingParams(temperature=temperature, seed=1000 + t, max_tokens=max_tokens,
                            ignore_eos=True)
    alone, rows_alone = _run(engine, tap, [(0, "s", prompt, params)], "s")
    k = rng.randint(7, 15)
    # NOTE: all at once, the seeded request in the middle of the crowd; or staggered: the
    # crowd arrives one request every 3 steps around it, so its decode steps also share
    # batches with other requests' prefills
    crowd = [(3 * i if staggered else 0, f"g{i}", rng.choice(STARTS),
              SamplingParams(temperature=0.0, max_tokens=rng.randint(8, max_tokens),
                             ignore_eos=True)) for i in range(k)]
    start = crowd[k // 2][0]
    batched, rows_batched = _run(engine, tap, crowd + [(start, "s", prompt, params)], "s")
    same = [i for i in range(min(len(alone), len(batched))) if alone[i] != batched[i]]
    first = same[0] if same else None
    shared = len(alone) if first is None else first + 1
    diffs = [float(np.abs(a - b).max()) for a, b in zip(rows_alone[:shared], rows_batched)]
    # the race's noise for step i is the seeded generator's i-th draw
    gen = torch.Generator().manual_seed(params.seed)
    vocab = rows_alone[0].shape[0]
    gaps = []
    for row in rows_alone[:shared]:
        noise = torch.empty(vocab).exponential_(generator=gen).numpy().astype(np.float64)
        gaps.append(_race_gap(row, temperature, noise))
    return {"trial": t, "crowd": k, "changed": first is not None,
            "first_diff_token": first, "max_logit_abs_diff": max(diffs) if diffs else 0.0,
            "steps_with_logit_diff": sum(d > 0 for d in diffs), "steps_compared": len(diffs),
            "min_race_gap": min(gaps) if gaps else None,
            **({"text_alone": engine.tokenizer.decode(alone),
                "text_batched": engine.tokenizer.decode(batched)} if first is not None else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--models", default=f"{DEFAULT_MODEL},"
                    f"{os.path.join(ROOT, '..', 'shared', 'models', 'stories3m')}")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results",
                                                     "seed_batch_invariance.json"))
    args = ap.parse_args()
    results = []
    for path in args.models.split(","):
        path = os.path.normpath(path)
        if not os.path.isdir(path):
            print(f"skipping {path}: not a folder")
            continue
        engine = LLMEngine.from_engine_args(path, max_num_seqs=16, dtype="float32",
                                            device="cpu")
        tap = LogitTap(engine)
        for staggered in (False, True):
            runs = [trial(engine, tap, t, args.temperature, args.max_tokens, staggered)
                    for t in range(args.trials)]
            results.append(_summary(os.path.basename(path), staggered, runs))
    print_table([{k: v for k, v in r.items() if k != "trials"} for r in results])
    write_json(args.output, {"threads": torch.get_num_threads(),
                             "temperature": args.temperature, "max_tokens": args.max_tokens,
                             "results": results})


def _summary(model: str, staggered: bool, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "arrival": "staggered" if staggered else "together",
            "trials": runs,
            "changed": sum(r["changed"] for r in runs),
            "max_logit_abs_diff": max(r["max_logit_abs_diff"] for r in runs),
            "steps_with_logit_diff": sum(r["steps_with_logit_diff"] for r in runs),
            "steps_compared": sum(r["steps_compared"] for r in runs),
            "min_race_gap": min(r["min_race_gap"] for r in runs)}


if __name__ == "__main__":
    main()
