"""Quality of nybble's quantizers against fp32 on the full held-out text (issue 14, item 1).

For each model (default: shared/models/stories3m) and configuration (default: 4-bit g128 with
rtn, gptq, gptq + act order, awq, gptq-e2e; 8-bit g128 with rtn and gptq), quantize calibrated
on all of ``stories-calib.txt`` (up to 128 sequences of 512 tokens) and measure, on the model
the engine loads from the written folder (fp32 activations, CPU):
* perplexity on **all** stories of ``stories-heldout.txt`` with ``nybble eval-ppl``'s model and
  protocol (each story with BOS, every token after BOS scored, windows of 512 advancing by 256);
* the fraction of RTN's perplexity gap closed, ``(ppl_rtn - ppl) / (ppl_rtn - ppl_fp32)``,
  against asymmetric RTN at the same bits and group size;
* greedy-token agreement with fp32 (32 prompts from the end of the held-out text, 32 fp32
  greedy tokens each, the quantized model teacher-forced);
* the bytes of the decoder's linear layers as loaded, quantization wall time, and the sha256
  of the written ``model.safetensors`` (the determinism check: rerun, compare).
Folders are kept under ``--keep`` so ``benchmarks/eval_ppl_check.py`` can re-check them with
transformers. Prints a table and writes benchmarks/results/quant_quality.json.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
import torch  # noqa: E402
from _report import print_table, write_json  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from nybble.quant.linear import weight_bytes  # noqa: E402
from nybble.quantize.driver import QuantizeOptions, quantize_model  # noqa: E402
from nybble.quantize.eval_ppl import (  # noqa: E402
    LogitsFn,
    greedy_agreement,
    greedy_continuations,
    nybble_model,
    perplexity,
    split_paragraphs,
)

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(_HERE), "..", "shared"))
CONFIGS: list[tuple[str, int, int, dict]] = [
    ("rtn", 4, 128, {}), ("gptq", 4, 128, {}), ("gptq", 4, 128, {"desc_act": True}),
    ("awq", 4, 128, {}), ("gptq-e2e", 4, 128, {}), ("rtn", 8, 128, {}), ("gptq", 8, 128, {})]
"""(method, bits, group size, extra QuantizeOptions); every row asymmetric."""


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of every Linear-like module inside the decoder layers (packed or dense)."""
    return sum(weight_bytes(mod) for name, mod in model.named_modules()
               if ".layers." in f".{name}" and name.rsplit(".", 1)[-1].endswith("_proj"))


def label(method: str, bits: int, gs: int, extra: dict) -> str:
    """Row name, e.g. ``gptq w4 g128 act-order``."""
    return f"{method} w{bits} g{gs}" + (" act-order" if extra.get("desc_act") else "")


def run_model(path: str, heldout: str, calib: str, args: argparse.Namespace) -> list[dict]:
    tok = AutoTokenizer.from_pretrained(path)
    name = os.path.basename(os.path.normpath(path))
    fp, fp_fn = nybble_model(path)
    stories = split_paragraphs(heldout)
    prompts = [tok(" ".join(s.split()[:6]))["input_ids"] for s in stories[-32:]]
    seqs = greedy_continuations(fp_fn, prompts, 32)
    lens = [len(p) for p in prompts]
    fp_lin = linear_bytes(fp.model)
    rows: list[dict] = []

    def evaluate(cfg: str, model: tuple[object, LogitsFn], extra: dict) -> dict:
        t = time.time()
        ppl = perplexity(model[1], tok, heldout, max_paragraphs=args.max_stories)
        lb = linear_bytes(model[0].model)  # type: ignore[attr-defined]
        row = {"model": name, "config": cfg, "perplexity": ppl["perplexity"],
               "gap_closed": None, "greedy_agreement": greedy_agreement(model[1], seqs, lens),
               "linear_weight_bytes": lb, "linear_bytes_vs_fp16": lb / (fp_lin / 2),
               "eval_tokens": int(ppl["tokens"]), **extra}
        rows.append(row)
        print(f"  {cfg:<24} ppl {row['perplexity']:.4f}  agree {row['greedy_agreement']:.3f}  "
              f"[{time.time() - t:.0f}s]", flush=True)
        return row

    print(f"== {path}", flush=True)
    fp_row = evaluate("fp32", (fp, fp_fn), {})
    rtn: dict[tuple[int, int], float] = {}
    for method, bits, gs, extra in args.configs:
        cfg = label(method, bits, gs, extra)
        out = os.path.join(args.keep, f"{name}-{cfg.replace(' ', '-')}")
        t = time.time()
        opts = QuantizeOptions(method=method, bits=bits, group_size=gs, sym=False,
                               calib_text=calib, calib_source="stories-calib.txt",
                               num_samples=args.num_samples, seq_len=args.seq_len, **extra)
        quantize_model(path, out, opts, progress=False)
        qt = time.time() - t
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        row = evaluate(cfg, nybble_model(out), {"quantize_seconds": qt,
                                                "folder": os.path.basename(out),
                                                "safetensors_sha256": sha})
        if method == "rtn":
            rtn[(bits, gs)] = row["perplexity"]
        if (bits, gs) in rtn and rtn[(bits, gs)] > fp_row["perplexity"]:
            row["gap_closed"] = ((rtn[(bits, gs)] - row["perplexity"])
                                 / (rtn[(bits, gs)] - fp_row["perplexity"]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="*", default=[f"{SHARED}/models/stories3m"])
    p.add_argument("--max-stories", type=int, default=None,
                   help="score only the first N held-out stories (default: all)")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--keep", default=os.path.join(os.path.expanduser("~"), ".cache", "nybble",
                                                  "quant-quality"),
                   help="folder for the quantized checkpoints")
    p.add_argument("--out", default=os.path.join(_HERE, "results", "quant_quality.json"))
    args = p.parse_args()
    args.configs = CONFIGS
    torch.set_num_threads(1)
    with open(f"{SHARED}/data/stories-heldout.txt", encoding="utf-8") as f:
        heldout = f.read()
    with open(f"{SHARED}/data/stories-calib.txt", encoding="utf-8") as f:
        calib = f.read()
    rows = []
    for m in args.models:
        rows += run_model(m, heldout, calib, args)
    print_table([{k: r.get(k) for k in ("model", "config", "perplexity", "gap_closed",
                                        "greedy_agreement", "linear_weight_bytes",
                                        "linear_bytes_vs_fp16", "quantize_seconds")}
                 for r in rows], "quantization quality (full held-out text)")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "configs")}
    settings["models"] = [os.path.basename(os.path.normpath(m)) for m in args.models]
    settings["configs"] = [label(*c) for c in CONFIGS]
    write_json(args.out, {"settings": settings, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
