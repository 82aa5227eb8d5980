"""What each CPU activation kind of the quantized matmuls costs in accuracy (issue 22: "the
default path within +0.25% perplexity of the exact one").

For each model (a GGUF file or a quantized folder) and each ``--cpu-activation-dtype``
(``float32``: the exact path; ``int16``, ``bfloat16``, ``int8``), nybble's own model scores
held-out text by :func:`nybble.quantize.eval_ppl.perplexity` (sliding windows of 512 advancing
by 256, as ``nybble eval-ppl``), and, for a chat model, answers a fixed question greedily
(``--question``, 12 tokens, its chat template). The kinds the CPU cannot run fast still run
(the portable C loop computes the same numbers). Prints a table and writes
``benchmarks/results/cpu_activation_ppl.json``.

Run: ``OMP_NUM_THREADS=1 python benchmarks/cpu_activation_ppl.py [MODEL ...]
[--max-paragraphs 20]`` (default models: ``../shared``'s SmolLM2-135M-Instruct Q4_1 and the
stories3m Q4_0 / Q8_0 / Q4_K_M fixtures).
"""
from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
import torch  # noqa: E402
from _report import print_table, write_json  # noqa: E402
from nybble.gguf.side_folder import ensure_side_folder  # noqa: E402
from nybble.quantize.eval_ppl import nybble_model, perplexity  # noqa: E402
from nybble.tokenizer.hf_tokenizer import load_tokenizer  # noqa: E402

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(_HERE), "..", "shared"))
DEFAULT_MODELS = [
    f"{SHARED}/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    f"{SHARED}/fixtures/gguf/stories3m-Q4_0.gguf",
    f"{SHARED}/fixtures/gguf/stories3m-Q8_0.gguf",
    f"{SHARED}/fixtures/gguf/stories3m-Q4_K_M.gguf",
]
KINDS = ("float32", "int16", "bfloat16", "int8")


def _greedy(logits_fn, tok, template: str | None, question: str, n: int) -> str:
    """The model's greedy answer to ``question`` in its chat template ("" without one)."""
    if not template:
        return ""
    ids = tok.encode_conversation([{"role": "user", "content": question}])
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(logits_fn(ids + out)[-1])))
        if out[-1] in tok.special_ids:
            break
    return tok.decode(out, skip_special_tokens=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--text", default=f"{SHARED}/data/stories-heldout.txt")
    ap.add_argument("--max-paragraphs", type=int, default=20)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--output", default=os.path.join(_HERE, "results", "cpu_activation_ppl.json"))
    args = ap.parse_args()
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    rows = []
    for model in args.models:
        folder = ensure_side_folder(model) if model.endswith(".gguf") else model
        tok, _ = load_tokenizer(folder)
        template = tok.chat_template

        def hf_style(text: str, tok=tok) -> dict[str, list[int]]:
            return {"input_ids": tok.encode(text)}
        exact = None
        for kind in args.kinds.split(","):
            _, fn = nybble_model(model, cpu_activation_dtype=kind)
            res = perplexity(fn, hf_style, text, max_paragraphs=args.max_paragraphs)
            ppl = res["perplexity"]
            exact = ppl if kind == "float32" else exact
            rows.append({"model": os.path.basename(model), "activations": kind,
                         "perplexity": round(ppl, 4),
                         "vs_exact_pct": (round(100 * (ppl / exact - 1), 3)
                                          if exact is not None else None),
                         "tokens": int(res["tokens"]),
                         "answer": _greedy(fn, tok, template, args.question, 12)})
            print(rows[-1], flush=True)
    print_table(rows, title=f"perplexity by CPU activation kind, {args.max_paragraphs} "
                            f"paragraphs, load {os.getloadavg()[0]:.2f}")
    write_json(args.output, {"rows": rows, "text": args.text,
                             "max_paragraphs": args.max_paragraphs, "question": args.question,
                             "load_average": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
