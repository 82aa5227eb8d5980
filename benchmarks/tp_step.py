"""Tensor parallelism on the CPU: engine step time at TP=1 and TP=2, and the share of rank 0's
step spent in collectives (all-reduce, logits gather, step broadcast).

Expect TP=2 to be slower here: both ranks share the machine's cores, the models are small
(a step is a few ms of compute) and every layer adds two all-reduces over loopback gloo; the
figure is for the record, not a speed-up. Per model and TP size: ``LLM.generate`` of
``--seqs`` greedy requests (``--max-tokens`` each, one batch), one torch thread per rank; rank
0's decode steps (every sequence decoding, ``max_query_len == 1``) are timed around
``ModelRunner.execute`` and the time inside ``TPGroup.all_reduce`` / ``gather_last_dim`` and
the command channel's ``send`` is summed per step. Medians over ``--repeats`` runs, TP=1 and
TP=2 alternating.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/tp_step.py [--repeats 3]``; prints a table and
writes ``benchmarks/results/tp_step.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble import LLM, SamplingParams
from nybble.bench.models import RandomLlamaShape, random_llama
from nybble.bench.report import print_table, write_json
from nybble.distributed import channel
from nybble.distributed.comm import TPGroup

SHARED = os.path.join(ROOT, "..", "shared")
MEDIUM = RandomLlamaShape(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                          max_position_embeddings=512)


class CommClock:
    """Seconds rank 0 spends inside the collectives (patched onto :class:`TPGroup` and the
    channel's ``send``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for owner, name in ((TPGroup, "all_reduce"), (TPGroup, "gather_last_dim"),
                            (channel, "send")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return run


def run(model: str, tp: int, seqs: int, max_tokens: int, clock: CommClock) -> dict[str, float]:
    """Median decode-step time and collective time per decode step (ms) of one engine run."""
    llm = LLM(model=model, tensor_parallel_size=tp, threads=1, max_num_seqs=seqs)
    core = llm.llm_engine.engine_core
    runner = core.runner
    execute = runner.execute
    steps: list[tuple[float, float]] = []

    def timed(batch):  # type: ignore[no-untyped-def]
        c0, t0 = clock.seconds, time.perf_counter()
        out = execute(batch)
        if batch.max_query_len == 1 and batch.num_seqs == seqs:
            steps.append((time.perf_counter() - t0, clock.seconds - c0))
        return out

    runner.execute = timed
    prompts = [f"Once upon a time number {i} there was" for i in range(seqs)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True), use_tqdm=False)
    finally:
        core.shutdown()
    step_ms = statistics.median(s for s, _ in steps) * 1e3
    comm_ms = statistics.median(c for _, c in steps) * 1e3
    return {"step_ms": step_ms, "comm_ms": comm_ms, "steps": len(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    models = {"stories3m": os.path.join(SHARED, "models", "stories3m"),
              "llama-h512-l8-v8k": random_llama(MEDIUM)}
    clock = CommClock()
    rows: list[dict[str, Any]] = []
    for name, path in models.items():
        runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for _ in range(args.repeats):
            for tp in (1, 2):
                runs[tp].append(run(path, tp, args.seqs, args.max_tokens, clock))
        for tp, rs in runs.items():
            step = statistics.median(r["step_ms"] for r in rs)
            comm = statistics.median(r["comm_ms"] for r in rs)
            rows.append({"model": name, "tp": tp, "decode_step_ms": step,
                         "collectives_ms": comm, "collectives_share": comm / step,
                         "steps_per_run": rs[0]["steps"]})
    table = print_table(rows, f"decode step, batch {args.seqs}, 1 torch thread per rank, "
                              f"gloo on loopback (median of {args.repeats})")
    write_json(os.path.join(ROOT, "benchmarks", "results", "tp_step.json"),
               {"args": vars(args), "load_avg": os.getloadavg(), "rows": rows,
                "table": table})


if __name__ == "__main__":
    main()
