"""Multi-LoRA serving cost: tokens/s of 64 concurrent requests spread over 0, 1, 4 and 8 adapters.

What users ask vLLM about: how much slower a batch gets as its requests use more distinct
adapters. Per base model, one ``LLM`` with LoRA off and one with ``enable_lora`` (8 slots,
rank <= 16) run the same 64 prompts (openings of held-out stories, greedy, ``ignore_eos``,
``--max-tokens`` each) in one ``generate`` call: LoRA off; LoRA on with every request on the
base; and request ``i`` on adapter ``i % k`` for ``k`` = 1, 4, 8 (rank-16 PEFT adapters on
q/k/v/o and gate/up/down, random ``A`` and ``B``, made here with PEFT's ``save_pretrained``). The
configurations alternate within each repeat; each cell is the median of ``--repeats`` of
generated tokens / wall seconds, with its ratio to "LoRA off".

Bases: the bundled stories260k (float32) and SmolLM2-135M-Instruct as the GGUF Q4_1 file in
``../shared/models/smollm2-135m-instruct/`` (a 4-bit base: QLoRA's serving case; its adapters
are made on transformers' float32 loading of that file).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/lora.py [--models bundled smollm2] [--repeats 3]
[--max-tokens 32]``; prints a table and writes ``benchmarks/results/lora.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
import torch  # noqa: E402

from nybble import LLM, LoRARequest, SamplingParams  # noqa: E402
from nybble.bench.report import print_table, write_json  # noqa: E402
from nybble.config import DEFAULT_MODEL  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared")
SMOLLM2 = os.path.join(SHARED, "models", "smollm2-135m-instruct")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUESTS = 64
ADAPTER_COUNTS = (1, 4, 8)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prompts(n: int) -> list[str]:
    """The first 8 words of the first ``n`` held-out stories."""
    with open(os.path.join(SHARED, "data", "stories-heldout.txt"), encoding="utf-8") as f:
        stories = [s for s in f.read().split("\n\n") if s.strip()]
    return [" ".join(s.split()[:8]) for s in stories[:n]]


def make_adapters(name: str, folder: str, count: int) -> list[str]:
    """``count`` rank-16 PEFT adapters (alpha 32, every projection, ``A``/``B`` random) of base
    ``name`` saved under ``folder``; their folders."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if name == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(SMOLLM2, gguf_file=GGUF,
                                                     torch_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                  target_modules=TARGETS))
    paths = []
    for i in range(count):      # one PEFT model, its A and B drawn again per adapter
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_A" in pname or "lora_B" in pname:
                    scale = 0.01 if "lora_B" in pname else 0.1
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        path = os.path.join(folder, f"{name}-{i}")
        peft_model.save_pretrained(path)
        paths.append(path)
    return paths


def run(llm: LLM, texts: list[str], params: SamplingParams,
        loras: list[LoRARequest | None] | None) -> float:
    """Generated tokens / wall seconds of one ``generate`` of ``texts``."""
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def bench_model(name: str, repeats: int, max_tokens: int, folder: str) -> list[dict[str, Any]]:
    """The rows of one base model."""
    model = os.path.join(SMOLLM2, GGUF) if name == "smollm2" else DEFAULT_MODEL
    paths = make_adapters(name, folder, max(ADAPTER_COUNTS))
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    texts = prompts(REQUESTS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    off = LLM(model, threads=1)
    on = LLM(model, threads=1, enable_lora=True, max_loras=max(ADAPTER_COUNTS),
             max_lora_rank=16, max_num_seqs=REQUESTS)
    configs: dict[str, tuple[LLM, list[LoRARequest | None] | None]] = {
        "LoRA off": (off, None), "0 adapters (LoRA on)": (on, None)}
    for k in ADAPTER_COUNTS:
        configs[f"{k} adapter{'s' if k > 1 else ''}"] = (
            on, [requests[i % k] for i in range(REQUESTS)])
    for llm, loras in configs.values():     # warm-up: loads every adapter into its slot
        run(llm, texts[:8], params, None if loras is None else loras[:8])
    samples: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(repeats):
        for label, (llm, loras) in configs.items():
            samples[label].append(run(llm, texts, params, loras))
    off.shutdown()
    on.shutdown()
    base = statistics.median(samples["LoRA off"])
    rows = []
    for label, values in samples.items():
        tps = statistics.median(values)
        rows.append({"model": name, "config": label,
                     "tok_s": round(tps, 1) if tps < 1000 else round(tps),
                     "vs_lora_off": round(tps / base, 3),
                     "samples": [round(v, 1) for v in values]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bundled", "smollm2"],
                        choices=["bundled", "smollm2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "lora.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        rows = [r for m in args.models for r in bench_model(m, args.repeats, args.max_tokens,
                                                            folder)]
    print_table([{k: r[k] for k in ("model", "config", "tok_s", "vs_lora_off")} for r in rows],
                f"{REQUESTS} concurrent requests x {args.max_tokens} tokens, one thread")
    write_json(args.out, {"setup": {"load_before": load_before, "load_after": os.getloadavg(),
                                    "requests": REQUESTS, "max_tokens": args.max_tokens,
                                    "repeats": args.repeats, "rank": 16, "threads": 1},
                          "rows": rows})


if __name__ == "__main__":
    main()
