"""Are nybble's GGUF files better than ``llama-quantize``'s? Perplexity by llama.cpp itself.

For each float model (``--model``, Hugging Face folders):

1. ``F32``: the float model as a GGUF (nybble's writer, dense; on stories3m it equals llama.cpp's
   own converter tensor for tensor: ``tests/quantize/test_gguf_export.py``).
2. ``llama-quantize`` of that file to Q4_0 and to Q4_1, with ``--token-embedding-type q8_0``
   (llama.cpp's round-to-nearest blocks; the embedding, which is also the tied head, in Q8_0).
3. ``nybble quantize --format gguf --quantize-lm-head`` of the same float folder at group size
   32: RTN symmetric (Q4_0; the control: the same kind of rounding as llama-quantize's),
   GPTQ symmetric (Q4_0) and GPTQ asymmetric (Q4_1), calibrated on nybble's default (text
   sampled from the model itself: no calibration data), the head Q8_0.

Every file is scored by llama.cpp's ``llama-perplexity`` (``-c 512``, one thread) on the same
held-out text, so the only difference between two rows of one type is how the 4-bit codes were
chosen. Prints a table and writes ``benchmarks/results/gguf_export_ppl.json``.

Run (llama.cpp built as in benchmarks/README.md, "A real model against llama-server"):
``python benchmarks/gguf_export_ppl.py --llama-build SCRATCH/build --model ../shared/models/stories3m
SCRATCH/smollm2/hf-f32 --work SCRATCH/gguf-export``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
from _report import print_table, write_json  # noqa: E402

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(_HERE), "..", "shared"))
_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def _run(cmd: list[str], log: str) -> str:
    """Run ``cmd``; its output goes to ``log`` and is returned. Raises on a non-zero exit."""
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={
            **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    with open(log, encoding="utf-8", errors="replace") as f:
        out = f.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}")
    return out


def llama_perplexity(binary: str, gguf: str, text: str, log: str) -> tuple[float, float]:
    """llama.cpp's perplexity of ``gguf`` on ``text``: (PPL, its +/-)."""
    out = _run([binary, "-m", gguf, "-f", text, "-c", "512", "-t", "1", "-b", "512"], log)
    match = _PPL.search(out)
    if match is None:
        raise RuntimeError(f"no 'Final estimate' in {log}")
    return float(match.group(1)), float(match.group(2))


def make_files(model: str, work: str, build: str) -> dict[str, str]:
    """The GGUF files of one model (made once; files that exist are kept)."""
    from nybble.quantize.gguf_export import write_gguf
    from nybble.quantize.hf_model import load_checkpoint_tensors, read_hf_config

    os.makedirs(work, exist_ok=True)
    files = {"F32": os.path.join(work, "f32.gguf")}
    if not os.path.exists(files["F32"]):
        write_gguf(files["F32"], load_checkpoint_tensors(model),
                   read_hf_config(model), model, {}, 4, True)
    for kind in ("Q4_0", "Q4_1"):
        path = files[f"llama-quantize {kind}"] = os.path.join(work, f"llama-{kind.lower()}.gguf")
        if not os.path.exists(path):
            _run([os.path.join(build, "bin", "llama-quantize"), "--token-embedding-type",
                  "q8_0", files["F32"], path, kind], path + ".log")
    for label, args in (("nybble RTN Q4_0", ["--method", "rtn", "--sym"]),
                        ("nybble GPTQ Q4_0", ["--method", "gptq", "--sym"]),
                        ("nybble GPTQ Q4_1", ["--method", "gptq"])):
        path = files[label] = os.path.join(work, label.split(" ", 1)[1].replace(" ", "-").lower()
                                           + ".gguf")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            _run([sys.executable, "-m", "nybble", "quantize", model, *args, "--bits", "4",
                  "--group-size", "32", "--quantize-lm-head", "--format", "gguf",
                  "--out", path], path + ".log")
            print(f"{label}: quantized in {time.perf_counter() - t0:.0f} s", flush=True)
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-build", required=True,
                    help="llama.cpp build folder (bin/llama-perplexity, bin/llama-quantize)")
    ap.add_argument("--model", nargs="+", default=[os.path.join(SHARED, "models", "stories3m")],
                    help="float Hugging Face folders")
    ap.add_argument("--text", default=os.path.join(SHARED, "data", "stories-heldout.txt"))
    ap.add_argument("--text-bytes", type=int, default=60000,
                    help="score only the text's first N bytes (0: all; llama-perplexity "
                         "scores whole 512-token chunks of it)")
    ap.add_argument("--work", required=True, help="where the GGUF files are made")
    ap.add_argument("--out", default=os.path.join(_HERE, "results", "gguf_export_ppl.json"))
    args = ap.parse_args()
    binary = os.path.join(args.llama_build, "bin", "llama-perplexity")
    text = args.text
    if args.text_bytes:
        os.makedirs(args.work, exist_ok=True)
        text = os.path.join(args.work, "text.txt")
        with open(args.text, "rb") as src, open(text, "wb") as dst:
            dst.write(src.read(args.text_bytes))
    rows = []
    for model in args.model:
        name = os.path.basename(os.path.normpath(model))
        work = os.path.join(args.work, name)
        files = make_files(model, work, args.llama_build)
        base = None
        for label, path in files.items():
            ppl, err = llama_perplexity(binary, path, text, path + ".ppl.log")
            base = base or ppl
            rows.append({"model": name, "file": label, "perplexity": round(ppl, 4),
                         "plus_minus": round(err, 4),
                         "vs_f32_pct": round((ppl / base - 1) * 100, 3),
                         "mib": round(os.path.getsize(path) / 2**20, 2)})
            print_table(rows[-1:], "")
    print_table(rows, "llama-perplexity (-c 512) on GGUF files of the same float model")
    write_json(args.out, {"models": args.model, "text": args.text,
                          "text_bytes": args.text_bytes, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
