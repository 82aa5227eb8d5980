"""``nybble quantize`` and ``nybble eval-ppl`` subcommands (``register(subparsers)``)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from nybble.config import CPU_ACTIVATION_DTYPES
from nybble.model_files import check_model_dir, config_folder, is_gguf
from nybble.runtime.worker.torch_threads import setup_threads
from nybble.threads import add_threads_arg

logger = logging.getLogger(__name__)


def check_out_dir(model_dir: str, out_dir: str, fmt: str = "hf") -> None:
    """Refuse an output that would overwrite the source model or that does not fit the
    format (checked before anything is written or imported). ``hf``: ``out_dir`` is a folder
    outside the source folder, not named ``*.gguf``; ``gguf``: it is the ``.gguf`` file to
    write (not a folder).

    Raises:
        ValueError: any of these fails.
    """
    src, out = os.path.realpath(model_dir), os.path.realpath(out_dir)
    if fmt == "gguf":
        if not out_dir.lower().endswith(".gguf") or os.path.isdir(out):
            raise ValueError(f"with --format gguf, --out must be the .gguf file to write "
                             f"(e.g. --out OUT/MODEL-Q4_0.gguf), got {out_dir!r}")
        return
    if out_dir.lower().endswith(".gguf"):
        raise ValueError(f"--out {out_dir!r} names a .gguf file: add --format gguf to write "
                         f"one, or name a folder for the Hugging Face (GPTQ/AWQ) layout")
    if out == src or out.startswith(src + os.sep):
        raise ValueError(f"--out must be a folder outside the source model folder {model_dir!r} "
                         f"(its weights would be overwritten), got {out_dir!r}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out must be a folder, got {out_dir!r}, which is a file")


def summary_line(summary: dict, group_size: int, lm_head: bool, out: str) -> str:
    """One sentence on what a quantize run did: how many decoder Linears were quantized, at
    which group sizes, and how many stayed dense."""
    quantized, regrouped, skipped = summary["quantized"], summary["regrouped"], summary["skipped"]
    sizes: dict[int, int] = {}
    for gs in regrouped.values():
        sizes[gs] = sizes.get(gs, 0) + 1
    parts = [f"{len(quantized) - len(regrouped)} at group size {group_size}"]
    parts += [f"{n} at group size {gs} ({group_size} does not divide their inputs)"
              for gs, n in sorted(sizes.items(), reverse=True)]
    dense = f"; {len(skipped)} left dense" if skipped else ""
    head = "; the output head as INT8" if lm_head else ""
    return (f"quantized {len(quantized)} of {len(quantized) + len(skipped)} decoder linear "
            f"layers ({', '.join(parts)}){dense}{head}; wrote {out}")


def _quantize(args: argparse.Namespace) -> int:
    if is_gguf(args.model):
        raise ValueError(f"nybble quantize reads a Hugging Face folder of float weights, got "
                         f"the GGUF file {args.model!r}; serve a GGUF file as it is (nybble "
                         f"serve {args.model}) or quantize the float model's folder")
    check_model_dir(args.model)
    check_out_dir(args.model, args.out, args.format)
    setup_threads(args.threads)  # NOTE: before torch is imported (next lines)
    from nybble.quant.report import report_path, summarize_report
    from nybble.quantize.driver import QuantizeOptions, quantize_model
    from nybble.quantize.e2e import TuneOptions

    def read(path: str | None) -> str | None:
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()

    opts = QuantizeOptions(method=args.method, bits=args.bits, group_size=args.group_size,
                           sym=args.sym, desc_act=args.desc_act,
                           static_groups=args.static_groups, damp_percent=args.damp_percent,
                           calib_text=read(args.calib), calib_source=args.calib,
                           num_samples=args.num_samples, seq_len=args.seq_len,
                           # NOTE: results depend on the thread count, so the quantizer pins
                           # one unless --threads says otherwise (not the machine's default)
                           clip=not args.no_clip, threads=args.threads or 1,
                           tune=TuneOptions(**{k: v for k, v in (
                               ("steps", args.tune_steps), ("batch", args.tune_batch),
                               ("lr", args.tune_lr)) if v is not None}),
                           eval_text=read(args.eval_text), eval_source=args.eval_text,
                           lm_head=args.quantize_lm_head,
                           allow_unquantized=args.allow_unquantized, format=args.format)
    summary = quantize_model(args.model, args.out, opts)
    print(summary_line(summary, opts.group_size, opts.lm_head, args.out), file=sys.stderr)
    print(json.dumps({"out": args.out, "quantized": len(summary["quantized"]),
                      "skipped": summary["skipped"], "regrouped": summary["regrouped"],
                      "report": os.path.basename(report_path(args.out)),
                      "summary": summarize_report(args.out),
                      "quantization_config": summary["config"]}, indent=2))
    return 0


def _eval_ppl(args: argparse.Namespace) -> int:
    check_model_dir(args.model)
    setup_threads(args.threads)  # NOTE: before torch is imported
    from transformers import AutoTokenizer

    from nybble.quantize.eval_ppl import nybble_logits_fn, perplexity

    logits_fn = nybble_logits_fn(args.model, args.quantization, args.cpu_activation_dtype)
    tok = AutoTokenizer.from_pretrained(config_folder(args.model))  # a GGUF's side folder
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    res = perplexity(logits_fn, tok, text, args.window, args.stride, args.max_paragraphs)
    print(json.dumps({"model": args.model, "text": args.text, **res}, indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``quantize`` and ``eval-ppl`` to the ``nybble`` command."""
    q = subparsers.add_parser(
        "quantize", help="quantize a model folder with RTN, GPTQ, AWQ or GPTQ+E2E",
        description="Quantize a Hugging Face Llama-family folder layer by layer on calibration "
                    "text and write a complete model folder in the GPTQ or AWQ format that "
                    "`nybble serve` loads, with quantization_report.json and a README.md "
                    "table beside the weights (or, with --format gguf, one GGUF file for "
                    "llama.cpp and nybble). The same inputs and thread count give "
                    "byte-identical files; quantizing runs on one thread unless --threads "
                    "is given.")
    q.add_argument("model", help="source model folder (Hugging Face Llama, float weights)")
    q.add_argument("--method", choices=["rtn", "gptq", "awq", "gptq-e2e"], required=True,
                   help="rtn: round to nearest; gptq: Frantar et al. 2023; awq: Lin et al. "
                        "2024; gptq-e2e: GPTQ, then the group scales tuned end to end against "
                        "the fp model (EfficientQAT's E2E-QP, Chen et al. 2024): the best "
                        "quality, written as GPTQ")
    q.add_argument("--bits", type=int, choices=[4, 8], default=4, help="weight bits")
    q.add_argument("--group-size", type=int, default=128,
                   help="input channels sharing one scale/zero point (-1: per output channel)")
    q.add_argument("--sym", action="store_true",
                   help="symmetric grid (RTN/GPTQ/GPTQ-E2E), written as AutoGPTQ's v1 "
                        "gptq; without it, gptq_v2 (GPTQModel's)")
    q.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ act order (default: on for gptq-e2e, off for gptq and with "
                        "--format gguf)")
    q.add_argument("--static-groups", action="store_true", help="GPTQ static groups")
    q.add_argument("--quantize-lm-head", action="store_true",
                   help="also quantize the output head: RTN symmetric INT8 at --group-size (32 "
                        "when per-channel), written as GPTQModel's lm_head: true; the "
                        "embedding stays float (a tied model's config is untied)")
    q.add_argument("--allow-unquantized", action="store_true",
                   help="write the checkpoint even when some decoder Linears cannot be "
                        "quantized with these settings (they stay dense); without it that "
                        "is an error and nothing is written. A group size that does not "
                        "divide a Linear's inputs is not such a case (except in AWQ's 4-bit "
                        "format and with --format gguf): that Linear gets the largest "
                        "multiple of 8 below it that divides, recorded per module in the "
                        "config")
    q.add_argument("--damp-percent", type=float, default=0.01,
                   help="GPTQ dampening, fraction of the mean Hessian diagonal")
    q.add_argument("--calib", help="calibration text file, blank-line separated documents "
                   "(default: text sampled from the model itself, enough tokens for the method: "
                   "4 per input channel of the widest layer, at least 2048)")
    q.add_argument("--num-samples", type=int, default=128,
                   help="at most this many calibration sequences")
    q.add_argument("--seq-len", type=int, default=512,
                   help="tokens per calibration sequence (at most the model's context)")
    q.add_argument("--no-clip", action="store_true", help="AWQ: skip the clipping search")
    # NOTE: None = TuneOptions' default (not imported here: it would load torch for --help)
    q.add_argument("--tune-steps", type=int, help="gptq-e2e: optimizer steps of the scale "
                                                  "tuning (default: 120)")
    q.add_argument("--tune-batch", type=int, help="gptq-e2e: calibration sequences per step "
                                                  "(default: 4)")
    q.add_argument("--tune-lr", type=float, help="gptq-e2e: Adam learning rate on the "
                                                 "log-scales (default: 0.002)")
    q.add_argument("--eval-text", help="held-out text (blank-line separated paragraphs): "
                                       "perplexity before and after goes into the report")
    q.add_argument("--format", choices=["hf", "gguf"], default="hf",
                   help="hf: a Hugging Face model folder (GPTQ, or AutoAWQ for 4-bit awq); "
                        "gguf: one GGUF file that llama.cpp and `nybble serve` load, "
                        "nybble's integer codes as they are: --group-size 32 only, 4-bit --sym -> "
                        "Q4_0, 4-bit asymmetric (awq too) -> Q4_1 (its per-block minimum "
                        "-scale*zero rounded to fp16, the one rounding), 8-bit --sym -> Q8_0; "
                        "no act order unless with --static-groups; 8-bit asymmetric is "
                        "refused. Checked before quantizing")
    q.add_argument("--out", required=True,
                   help="output model folder; with --format gguf the .gguf file to write "
                        "(e.g. OUT/MODEL-Q4_0.gguf), its quality report beside it as "
                        "MODEL-Q4_0.quantization_report.json")
    add_threads_arg(q, "1, so the same inputs give byte-identical files")
    q.set_defaults(func=_quantize)

    e = subparsers.add_parser(
        "eval-ppl", help="perplexity of a model on a text file",
        description="Sliding-window perplexity of a model folder (fp or quantized, run by "
                    "nybble's own model) on blank-line separated paragraphs of a text file.")
    e.add_argument("model", help="model folder (fp or quantized)")
    e.add_argument("--text", required=True, help="UTF-8 text, blank-line separated paragraphs")
    e.add_argument("--quantization", choices=["awq", "gptq", "compressed-tensors", "gguf"],
                   help="force the quantization method (default: detected)")
    e.add_argument("--window", type=int, default=512,
                   help="tokens per scoring window (at most the model's max_model_len)")
    e.add_argument("--stride", type=int, default=256,
                   help="tokens a window advances; each window scores only new tokens")
    e.add_argument("--max-paragraphs", type=int, default=None,
                   help="score only the first N paragraphs")
    e.add_argument("--cpu-activation-dtype", default="auto", choices=list(CPU_ACTIVATION_DTYPES),
                   help="activations of the CPU's quantized matmuls, as for nybble serve "
                        "(float32: the exact path)")
    add_threads_arg(e)
    e.set_defaults(func=_eval_ppl)
