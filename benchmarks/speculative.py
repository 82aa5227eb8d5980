"""Speculative decoding on stories3m: tokens/s against no speculation, and acceptance rates.

Target ``shared/models/stories3m`` (fp32, greedy, so every configuration emits the same
tokens), proposals from the bundled stories260k draft model or from n-gram lookup, at batch 1
(one request at a time, ``max_num_seqs`` 1) and batch 8 (8 requests together), on two prompt
sets: the openings of held-out stories (``shared/data/stories-heldout.txt``) and a repetitive,
code-like set (lists and repeated phrases, where n-gram lookup finds its proposals). Per
cell: generated tokens / wall seconds of ``LLM.generate`` (median of ``--repeats``, the
configurations alternating within each repeat), the acceptance rate (accepted / drafted
tokens) and the mean acceptance length (tokens emitted per sequence-step with drafts).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/speculative.py [--repeats 3] [--max-tokens 96]
[-k 3]``; prints a table and writes ``benchmarks/results/speculative.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
from nybble import LLM, SamplingParams
from nybble.bench.report import machine_meta, print_table, write_json
from nybble.config import DEFAULT_MODEL

SHARED = os.path.join(ROOT, "..", "shared")
TARGET = os.path.join(SHARED, "models", "stories3m")
REPETITIVE = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Tom said, \"Hi!\" Tom said, \"Hi!\" Tom said, \"Hi!\" Tom said,",
    "a = 1; b = 2; c = 3; a = 1; b = 2; c = 3; a = 1;",
    "The cat sat on the mat. The cat sat on the mat. The cat sat",
    "red, blue, red, blue, red, blue, red, blue,",
    "Lily ran and ran and ran and ran and ran and",
    "if x: y = 1 if x: y = 1 if x: y = 1 if x:",
    "One, two, three. One, two, three. One, two, three. One,",
]


def story_prompts(n: int) -> list[str]:
    """The first 8 words of the first ``n`` held-out stories."""
    with open(os.path.join(SHARED, "data", "stories-heldout.txt"), encoding="utf-8") as f:
        stories = [s for s in f.read().split("\n\n") if s.strip()]
    return [" ".join(s.split()[:8]) for s in stories[:n]]


def run(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> tuple[float, int]:
    """Wall seconds and generated tokens for ``prompts``, ``batch`` at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    args = p.parse_args()
    configs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 1},
        "draft stories260k": {"model": DEFAULT_MODEL, "num_speculative_tokens": args.k},
    }
    workloads = {"stories": story_prompts(8), "repetitive": REPETITIVE}
    rows = []
    for batch in (1, 8):
        llms = {name: LLM(TARGET, max_num_seqs=batch, num_gpu_blocks=512,
                          speculative_config=spec) for name, spec in configs.items()}
        for wname, prompts in workloads.items():
            times: dict[str, list[float]] = {name: [] for name in configs}
            counts: dict[str, int] = {}
            before = {name: _spec(llm) for name, llm in llms.items()}
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    secs, counts[name] = run(llm, prompts, batch, args.max_tokens)
                    times[name].append(secs)
            for name, llm in llms.items():
                secs = sorted(times[name])[len(times[name]) // 2]
                drafts, drafted, accepted = (a - b for a, b in zip(_spec(llm), before[name]))
                base = sorted(times["none"])[len(times["none"]) // 2]
                rows.append({
                    "batch": batch, "prompts": wname, "proposer": name,
                    "tok/s": round(counts[name] / secs, 1),
                    "vs none": round(base / secs, 2),
                    "acceptance": None if not drafted else round(accepted / drafted, 3),
                    "mean accepted len": None if not drafts else round(1 + accepted / drafts,
                                                                        2)})
        del llms
    print_table(rows, f"speculative decoding, stories3m target, k={args.k}, greedy, "
                      f"{args.max_tokens} tokens per request, median of {args.repeats}")
    write_json(os.path.join(ROOT, "benchmarks", "results", "speculative.json"),
               {"meta": machine_meta(), "args": vars(args), "rows": rows,
                "load_average": os.getloadavg()})


def _spec(llm: LLM) -> tuple[int, int, int]:
    stats = llm.llm_engine.engine_core.get_stats().spec_decode
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


if __name__ == "__main__":
    main()
