"""The cost of prefix caching on a workload with no shared prefix (it can only cost there).

Prompts are random token ids (BOS first, then ids drawn from the non-special vocabulary), so
no full block of one prompt equals a block of another: every lookup misses, and what remains
is the price of hashing each full block, registering it and parking freed blocks. Two
offline ``LLM`` engines on the bundled model, identical but for ``enable_prefix_caching``,
generate the same requests (greedy, ``ignore_eos``, so every request generates exactly its
length) in alternating runs (on off, off on, ...); each figure is the median of
``--repeats`` runs. The bundled model is tiny, so the engine's host work (where the cache
works) is the largest share of a step: the worst case for the relative cost.

Run: ``python benchmarks/prefix_caching_cost.py [--num-prompts 64] [--repeats 5]``; prints a
table and writes ``benchmarks/results/prefix_caching_cost.json`` (with the load average).
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
from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` ids: BOS (1), then random ids in ``[3, vocab)``."""
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, vocab, length - 1).tolist()] for _ in range(num)]


def time_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Seconds to generate every prompt."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return elapsed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON; returns the payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="runs per setting (median)")
    parser.add_argument("--out", default=os.path.join(_HERE, "results",
                                                      "prefix_caching_cost.json"))
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    engines = {on: LLM(DEFAULT_MODEL, enable_prefix_caching=on, max_num_seqs=args.max_num_seqs,
                       threads=1) for on in (True, False)}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in engines.values():   # warm-up (allocator, first-call costs)
        time_run(llm, make_prompts(4, args.input_len, 512, seed=10_000), params)
    runs: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeats):
        # NOTE: fresh prompts each repeat (the cache outlives a run), the same for both
        prompts = make_prompts(args.num_prompts, args.input_len, 512, seed=r)
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            runs[on].append(time_run(engines[on], prompts, params))
    hits = engines[True].llm_engine.get_stats().num_cached_tokens_total
    on_s, off_s = statistics.median(runs[True]), statistics.median(runs[False])
    tokens = args.num_prompts * (args.input_len + args.output_len)
    rows = [{"prefix_caching": name, "median_s": s, "tokens_per_s": tokens / s,
             "runs_s": runs[on]} for name, on, s in (("on", True, on_s), ("off", False, off_s))]
    cost = on_s / off_s - 1
    print_table([{k: v for k, v in row.items() if k != "runs_s"} for row in rows],
                title=f"prefix caching, no shared prefix ({args.num_prompts} prompts x "
                      f"{args.input_len} + {args.output_len} tokens, stories260k, CPU, 1 "
                      f"thread; median of {args.repeats}); cost {cost:+.1%}, cache hits "
                      f"{hits} tokens")
    payload = {"rows": rows, "relative_cost": cost, "cache_hit_tokens": hits,
               "args": vars(args), "load_average_before": load_before,
               "load_average_after": os.getloadavg()}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
