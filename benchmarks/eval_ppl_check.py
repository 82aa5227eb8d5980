"""``nybble eval-ppl`` against transformers on the same quantized weights (issue 14, item 6).

For every model folder given (fp or quantized, GPTQ v1/v2 or AWQ GEMM as written by any tool):
1. nybble's figure: :func:`nybble.quantize.eval_ppl.perplexity` with nybble's own model (what
   ``nybble eval-ppl`` and ``nybble serve`` run; float32, CPU);
2. the oracle: transformers' ``LlamaForCausalLM`` built from the folder's ``config.json``
   (quantization stripped), float32, loaded with a state dict in which every quantized Linear's
   weight is decoded here, independently of nybble's loaders, with numpy from the published
   layouts (docs/quant-formats.md §3.2-3.5 GPTQ, §4.2-4.3 AWQ), scored by the same
   sliding-window protocol (every story with BOS, each token after BOS scored, windows of 512
   advancing by 256).
The two must agree to ``--tol`` (default 1e-3) in perplexity; the script exits 1 otherwise.
Prints a table and writes ``benchmarks/results/eval_ppl_check.json``.

Run: ``python benchmarks/eval_ppl_check.py FOLDER [FOLDER ...] [--text FILE]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
from _report import print_table, write_json  # noqa: E402

from nybble.quantize.eval_ppl import hf_logits_fn, nybble_logits_fn, perplexity  # noqa: E402

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(_HERE), "..", "shared"))
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _fields(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unpack int32 words along ``axis`` (field i = bits [bits*i, bits*i+bits))."""
    u = words.astype(np.uint32)
    pf = 32 // bits
    parts = [(u >> np.uint32(bits * i)) & np.uint32((1 << bits) - 1) for i in range(pf)]
    st = np.stack(parts, axis=axis + 1)  # field index right after the packed axis
    shape = list(words.shape)
    shape[axis] *= pf
    return st.reshape(shape).astype(np.int64)


def decode_gptq(t: dict[str, np.ndarray], bits: int, gs: int, sym: bool, v2: bool) -> np.ndarray:
    """``W [N, K]`` float32: ``scales[g, n] * (q[k, n] - z[g, n])`` (§3.5)."""
    q = _fields(t["qweight"], bits, 0)  # [K, N]
    k, n = q.shape
    g = t["g_idx"].astype(np.int64) if "g_idx" in t else np.arange(k) // (k if gs == -1 else gs)
    if sym:
        z = np.full((t["scales"].shape[0], n), 1 << (bits - 1))
    else:
        z = (_fields(t["qzeros"], bits, 1)[:, :n] + (0 if v2 else 1)) & ((1 << bits) - 1)
    w = (q - z[g]).astype(np.float32) * t["scales"].astype(np.float32)[g]
    return w.astype(np.float16).astype(np.float32).T  # the published fp16 rounding


def decode_awq(t: dict[str, np.ndarray], gs: int) -> np.ndarray:
    """AWQ GEMM 4-bit: interleaved fields, ``W = scales * (q - z)`` (§4.2-4.3)."""
    inv = [AWQ_ORDER.index(j) for j in range(8)]

    def unpack(words: np.ndarray) -> np.ndarray:
        f = _fields(words, 4, 1).reshape(words.shape[0], words.shape[1], 8)
        return f[:, :, inv].reshape(words.shape[0], -1)
    q, z = unpack(t["qweight"]), unpack(t["qzeros"])
    g = np.arange(q.shape[0]) // (q.shape[0] if gs == -1 else gs)
    w = (q - z[g]).astype(np.float32) * t["scales"].astype(np.float32)[g]
    return w.astype(np.float16).astype(np.float32).T


def oracle_model(model_dir: str) -> torch.nn.Module:
    """transformers' causal LM with every quantized Linear decoded to float32 here."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    qc = cfg.pop("quantization_config", None)
    arrays: dict[str, np.ndarray] = {}
    for fname in sorted(os.listdir(model_dir)):
        if fname.endswith(".safetensors") and not fname.startswith("reference_outputs"):
            arrays.update(load_file(os.path.join(model_dir, fname)))
    state: dict[str, torch.Tensor] = {}
    prefixes = sorted({k[:-len(".qweight")] for k in arrays if k.endswith(".qweight")})
    for p in prefixes:
        t = {k[len(p) + 1:]: arrays.pop(k) for k in list(arrays) if k.startswith(p + ".")}
        assert qc is not None, f"{model_dir} stores {p}.qweight without a quantization_config"
        if qc["quant_method"] == "awq":
            w = decode_awq(t, int(qc["group_size"]))
        else:
            fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
            w = decode_gptq(t, int(qc["bits"]), int(qc["group_size"]), bool(qc.get("sym", True)),
                            fmt == "gptq_v2")
        state[p + ".weight"] = torch.from_numpy(np.ascontiguousarray(w))
        if "bias" in t and np.any(t["bias"]):
            state[p + ".bias"] = torch.from_numpy(t["bias"].astype(np.float32))
    state.update({k: torch.from_numpy(v.astype(np.float32)) for k, v in arrays.items()})
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight" and "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"state dict must match the model, got missing={missing[:4]} "
                         f"unexpected={unexpected[:4]}")
    if cfg.get("tie_word_embeddings"):
        model.tie_weights()
    return model.eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="model folders")
    p.add_argument("--text", default=os.path.join(SHARED, "data", "stories-heldout.txt"))
    p.add_argument("--max-paragraphs", type=int, default=None, help="default: the whole text")
    p.add_argument("--window", type=int, default=512, help="tokens per scoring window")
    p.add_argument("--stride", type=int, default=256, help="tokens a window advances")
    p.add_argument("--tol", type=float, default=1e-3, help="largest |ppl difference| allowed")
    p.add_argument("--out", default=os.path.join(_HERE, "results", "eval_ppl_check.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    rows = []
    for m in args.models:
        tok = AutoTokenizer.from_pretrained(m)
        ours = perplexity(nybble_logits_fn(m), tok, text, args.window, args.stride,
                          args.max_paragraphs)
        ref = perplexity(hf_logits_fn(oracle_model(m)), tok, text, args.window, args.stride,
                         args.max_paragraphs)
        rows.append({"model": os.path.basename(os.path.normpath(m)),
                     "nybble_eval_ppl": ours["perplexity"], "transformers": ref["perplexity"],
                     "abs_diff": abs(ours["perplexity"] - ref["perplexity"]),
                     "tokens": int(ours["tokens"]), "stories": int(ours["paragraphs"])})
        print(rows[-1], flush=True)
    print_table(rows, f"eval-ppl vs transformers on {os.path.basename(args.text)}")
    ok = all(r["abs_diff"] <= args.tol for r in rows)
    write_json(args.out, {"settings": {**vars(args), "out": os.path.basename(args.out),
                                       "text": os.path.basename(args.text),
                                       "models": [r["model"] for r in rows]},
                          "rows": rows, "all_within_tol": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
