"""Quality of RTN / GPTQ / AWQ quantization vs fp32 (issue "Quantization").

For each model (default: shared/models/stories3m and the bundled stories260k), quantize with
every method at 4-bit (g32, g64, g128 where the widths allow) and 8-bit, calibrated on
stories-calib.txt, and measure: perplexity on stories-heldout.txt (first --max-stories
stories, each tokenized with BOS, every token after BOS scored, sliding window 512/256),
greedy-token agreement with fp32 over 32 prompts (32 greedy fp32 tokens each, quantized model
teacher-forced), and the bytes of the decoder-layer linear weights. All numbers come from
nybble's own model as the engine loads the written folder (fp32 activations, CPU, torch
kernels). Prints a table and writes benchmarks/results/quant_quality.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nybble.config import DEFAULT_MODEL, ModelConfig
from nybble.kernels.reference_attention import TorchAttentionBackend
from nybble.models.loader import LoadedModel, load_model
from nybble.models.scoring import prefill_logits
from nybble.quant.linear import weight_bytes
from nybble.quantize.driver import QuantizeOptions, quantize_model
from nybble.quantize.eval_ppl import (
    LogitsFn,
    greedy_agreement,
    greedy_continuations,
    perplexity,
    split_paragraphs,
)

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "..", "shared"))


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of every Linear-like module inside the decoder layers (packed or dense)."""
    total = 0
    for name, mod in model.named_modules():
        if ".layers." in f".{name}" and name.rsplit(".", 1)[-1].endswith("_proj"):
            total += weight_bytes(mod)
    return total


def load(path: str) -> tuple[LoadedModel, LogitsFn]:
    """nybble's model for ``path`` and its whole-sequence logits function."""
    cpu = torch.device("cpu")
    loaded = load_model(ModelConfig(model=path, dtype="float32", device="cpu"),
                        TorchAttentionBackend(), cpu)
    return loaded, lambda ids: prefill_logits(loaded, [ids])[0]


def run_model(path: str, heldout: str, calib: str, args: argparse.Namespace) -> list[dict]:
    tok = AutoTokenizer.from_pretrained(path)
    fp, fp_fn = load(path)
    hidden = fp.hf_config.hidden_size
    stories = split_paragraphs(heldout)
    prompts = [tok(" ".join(s.split()[:6]))["input_ids"] for s in stories[-32:]]
    seqs = greedy_continuations(fp_fn, prompts, 32)
    lens = [len(p) for p in prompts]
    fp_lin = linear_bytes(fp.model)
    rows = []

    def evaluate(label: str, method: str, bits: int | None, gs: int | None,
                 model: tuple[LoadedModel, LogitsFn], extra: dict) -> None:
        t = time.time()
        ppl = perplexity(model[1], tok, heldout, max_paragraphs=args.max_stories)
        agree = greedy_agreement(model[1], seqs, lens)
        lb = linear_bytes(model[0].model)
        row = {"model": os.path.basename(os.path.normpath(path)), "config": label,
               "method": method, "bits": bits, "group_size": gs,
               "perplexity": ppl["perplexity"], "eval_tokens": int(ppl["tokens"]),
               "greedy_agreement": agree, "linear_weight_bytes": lb,
               "linear_bytes_vs_fp16": lb / (fp_lin / 2), **extra}
        rows.append(row)
        print(f"  {label:<16} ppl {row['perplexity']:.4f}  agree {agree:.3f}  "
              f"linear bytes {lb} ({row['linear_bytes_vs_fp16']:.3f}x fp16)  "
              f"[{time.time() - t:.0f}s]", flush=True)

    print(f"== {path}", flush=True)
    evaluate("fp32", "fp32", None, None, (fp, fp_fn), {"quantized_linears": 0, "skipped_linears": 0})
    configs = [(4, g) for g in (32, 64, 128) if hidden % g == 0] + [(8, 128 if hidden % 128 == 0
                                                                     else hidden)]
    for bits, gs in configs:
        for method in ("rtn", "gptq", "awq"):
            with tempfile.TemporaryDirectory() as out:
                t = time.time()
                opts = QuantizeOptions(method=method, bits=bits, group_size=gs, sym=False,
                                       calib_text=calib, num_samples=args.num_samples,
                                       seq_len=args.seq_len)
                s = quantize_model(path, out, opts, progress=False)
                qt = time.time() - t
                evaluate(f"{method} w{bits} g{gs}", method, bits, gs, load(out),
                         {"quantized_linears": len(s["quantized"]),
                          "skipped_linears": len(s["skipped"]), "quantize_seconds": qt})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="*",
                   default=[f"{SHARED}/models/stories3m", DEFAULT_MODEL])
    p.add_argument("--max-stories", type=int, default=100)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "quant_quality.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    with open(f"{SHARED}/data/stories-heldout.txt", encoding="utf-8") as f:
        heldout = f.read()
    with open(f"{SHARED}/data/stories-calib.txt", encoding="utf-8") as f:
        calib = f.read()
    rows = []
    for m in args.models:
        rows += run_model(m, heldout, calib, args)
    print("\n| model | config | ppl | greedy agree | linear bytes | vs fp16 | quantized/skipped |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['config']} | {r['perplexity']:.4f} | "
              f"{r['greedy_agreement']:.3f} | {r['linear_weight_bytes']} | "
              f"{r['linear_bytes_vs_fp16']:.3f} | {r['quantized_linears']}/{r['skipped_linears']} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        settings = {**vars(args), "out": os.path.basename(args.out),
                    "models": [os.path.basename(os.path.normpath(m)) for m in args.models]}
        json.dump({"settings": settings, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
