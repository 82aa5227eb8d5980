"""Host overhead of one scheduler step (schedule + update + block bookkeeping + output arrays).

Measures microseconds per step with 32, 256 and 1024 running decode sequences, for the Cython
``Scheduler`` and for ``PyScheduler``, a plain-Python version of the same scheduling loop kept
here for comparison. No model runs: sampled tokens are a constant. CPU only, no torch.

Run: ``python benchmarks/scheduler_overhead.py [--steps 200]``; prints a table and writes
``benchmarks/results/scheduler_overhead.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
from _report import print_table, write_json
from nybble.runtime.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_LEN = 128
MAX_MODEL_LEN = 2048


class PyScheduler:
    """Plain-Python reference of the scheduling loop (running first, then FCFS admission).

    Same rule and outputs as the Cython scheduler minus preemption and groups, which the
    steady-state decode benchmark never exercises (the pool is large enough).
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.bs, self.cap, self.budget, self.max_len = (block_size, max_num_seqs,
                                                        max_num_batched_tokens, max_model_len)
        self.mb = -(-max_model_len // block_size)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.seqs: dict[int, dict[str, Any]] = {}
        self.running: list[int] = []
        self.waiting: list[int] = []

    def add(self, seq_id: int, token_ids: list[int], max_tokens: int,
            stop_token_ids: tuple[int, ...] = ()) -> None:
        """Queue a request (FCFS)."""
        self.seqs[seq_id] = {"tokens": list(token_ids), "prompt": len(token_ids),
                             "computed": 0, "max_tokens": max_tokens,
                             "stop": set(stop_token_ids), "blocks": [], "sched": 0}
        self.waiting.append(seq_id)

    def _cover(self, s: dict[str, Any], n: int) -> bool:
        need = -(-(s["computed"] + n) // self.bs) - len(s["blocks"])
        if need > len(self.free):
            return False
        for _ in range(need):
            b = self.free.pop()
            self.ref[b] = 1
            s["blocks"].append(b)
        return True

    def schedule(self) -> dict[str, Any]:
        """Pick this step's rows and build the numpy output arrays."""
        budget, rows = self.budget, []
        for sid in self.running:
            s = self.seqs[sid]
            n = min(len(s["tokens"]) - s["computed"], budget)
            if n <= 0 or not self._cover(s, n):
                break
            s["sched"], budget = n, budget - n
            rows.append(sid)
        while self.waiting and budget > 0 and len(self.running) < self.cap:
            s = self.seqs[self.waiting[0]]
            n = min(len(s["tokens"]), budget)
            if not self._cover(s, n):
                break
            s["sched"], budget = n, budget - n
            self.running.append(self.waiting.pop(0))
            rows.append(self.running[-1])
        ids, pos, slots, tables, lens, qsl, samples = [], [], [], [], [], [0], []
        for sid in rows:
            s = self.seqs[sid]
            start, n, blocks = s["computed"], s["sched"], s["blocks"]
            for p in range(start, start + n):
                ids.append(s["tokens"][p])
                pos.append(p)
                slots.append(blocks[p // self.bs] * self.bs + p % self.bs)
            tables.append(blocks + [-1] * (self.mb - len(blocks)))
            lens.append(start + n)
            qsl.append(qsl[-1] + n)
            if start + n == len(s["tokens"]):
                samples.append(qsl[-1] - 1)
        return {"seq_ids": np.array(rows, np.int64), "input_ids": np.array(ids, np.int32),
                "positions": np.array(pos, np.int64),
                "slot_mapping": np.array(slots, np.int64),
                "block_tables": np.array(tables, np.int32).reshape(len(rows), self.mb),
                "seq_lens": np.array(lens, np.int32),
                "query_start_loc": np.array(qsl, np.int32),
                "sample_rows": np.array(samples, np.int32)}

    def update(self, batch: dict[str, Any], sampled: np.ndarray) -> list[tuple[int, int, int]]:
        """Advance computed tokens, append samples, finish and free."""
        out, done = [], set()
        qsl = batch["query_start_loc"].tolist()
        sample_set = set(batch["sample_rows"].tolist())
        k = 0
        for b, sid in enumerate(batch["seq_ids"].tolist()):
            s = self.seqs[sid]
            s["computed"] += s["sched"]
            if qsl[b + 1] - 1 not in sample_set:
                continue
            tok = int(sampled[k])
            k += 1
            s["tokens"].append(tok)
            fin = 1 if tok in s["stop"] else 0
            if not fin and (len(s["tokens"]) - s["prompt"] >= s["max_tokens"]
                            or len(s["tokens"]) >= self.max_len):
                fin = 2
            out.append((sid, tok, fin))
            if fin:
                for blk in reversed(s["blocks"]):
                    self.ref[blk] -= 1
                    if self.ref[blk] == 0:
                        self.free.append(blk)
                done.add(sid)
                del self.seqs[sid]
        if done:
            self.running = [sid for sid in self.running if sid not in done]
        return out


def _warm_to_decode(sched: Any, num_seqs: int, is_cython: bool) -> None:
    """Add ``num_seqs`` requests and step until every one of them is decoding."""
    for i in range(num_seqs):
        sched.add(i, list(range(PROMPT_LEN)), MAX_MODEL_LEN, (MAX_MODEL_LEN + 7,))
    for _ in range(10_000):
        batch = sched.schedule()
        n = batch.num_sampled if is_cython else len(batch["sample_rows"])
        sched.update(batch, np.full(n, 5, np.int32))
        tokens = batch.num_tokens if is_cython else len(batch["input_ids"])
        if tokens == num_seqs and n == num_seqs:
            return
    raise RuntimeError(f"`num_seqs` must reach steady decode, got stuck at {num_seqs}")


def time_steps(num_seqs: int, steps: int, is_cython: bool, repeats: int = 3) -> float:
    """Best-of-``repeats`` microseconds per decode step with ``num_seqs`` running."""
    best = float("inf")
    for _ in range(repeats):
        blocks = num_seqs * (-(-MAX_MODEL_LEN // BLOCK_SIZE)) // 4 + 64
        args = (blocks, BLOCK_SIZE, num_seqs, max(2048, num_seqs), MAX_MODEL_LEN)
        sched: Any = Scheduler(*args) if is_cython else PyScheduler(*args)
        _warm_to_decode(sched, num_seqs, is_cython)
        sampled = np.full(num_seqs, 5, np.int32)
        t0 = time.perf_counter()
        for _ in range(steps):
            sched.update(sched.schedule(), sampled)
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns the payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "scheduler_overhead.json"))
    args = parser.parse_args(argv)
    rows = []
    for n in (32, 256, 1024):
        cy = time_steps(n, args.steps, True)
        py = time_steps(n, args.steps, False)
        rows.append({"running_seqs": n, "cython_us_per_step": cy, "python_us_per_step": py,
                     "cython_us_per_seq": cy / n, "speedup": py / cy})
    print_table(rows, title="scheduler step overhead (decode, block_size 16, CPU)")
    payload = {"benchmark": "scheduler_overhead", "steps": args.steps,
               "block_size": BLOCK_SIZE, "prompt_len": PROMPT_LEN, "rows": rows}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
