"""Held-out perplexity of stories3m with a quantized KV cache (issue 14, item 4).

For each ``--kv-cache-dtype`` (``auto``: the fp32 cache, ``int8``, ``fp8_e4m3``): nybble's own
model (float32, CPU, the torch reference attention), the per-head scales calibrated as the
engine does at start-up (:func:`nybble.runtime.worker.kv_calibration.calibrate_kv_scales`), scored
by
``nybble eval-ppl``'s protocol (every story with BOS, windows of 512 tokens advancing by 256).
Prefill reads the keys and values back from the quantized cache, so every attention score of
the text goes through the quantization. Also prints the pool-size ratio: tokens a 256 MiB pool
holds with each dtype. Writes ``benchmarks/results/kv_cache_ppl.json``.

Run: ``python benchmarks/kv_cache_ppl.py [--text FILE] [--max-paragraphs N]``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script
from _report import print_table, write_json  # noqa: E402

from nybble.config import CacheConfig  # noqa: E402
from nybble.models.scoring import prefill_logits  # noqa: E402
from nybble.quantize.eval_ppl import nybble_model, perplexity  # noqa: E402
from nybble.runtime.worker.kv_plan import kv_storage_dtype, plan_kv_cache  # noqa: E402
from nybble.runtime.worker.kv_calibration import calibrate_kv_scales  # noqa: E402

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(_HERE), "..", "shared"))


def kv_perplexities(model_dir: str, text: str, dtypes: list[str],
                    max_paragraphs: int | None = None) -> list[dict]:
    """One row per KV dtype: perplexity, its change against ``auto``, pool tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    loaded, _ = nybble_model(model_dir)
    device = torch.device("cpu")
    rows = []
    for name in dtypes:
        cache_dtype = kv_storage_dtype(name, loaded.dtype)
        if name == "auto":
            for layer in loaded.model.layers:
                layer.self_attn.kv_scale = None
        else:
            calibrate_kv_scales(loaded, cache_dtype, device)
        ppl = perplexity(lambda ids: prefill_logits(loaded, [ids], device, cache_dtype)[0],
                         tok, text, max_paragraphs=max_paragraphs)
        spec = plan_kv_cache(CacheConfig(kv_cache_dtype=name), loaded.shape, loaded.dtype,
                             device)
        rows.append({"kv_cache_dtype": name, "perplexity": round(ppl["perplexity"], 5),
                     "tokens_scored": int(ppl["tokens"]),
                     "pool_tokens_256MiB": spec.num_blocks * spec.block_size})
    base = rows[0]
    for r in rows:
        r["ppl_change_pct"] = round((r["perplexity"] / base["perplexity"] - 1) * 100, 3)
        r["pool_ratio"] = round(r["pool_tokens_256MiB"] / base["pool_tokens_256MiB"], 3)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(SHARED, "models", "stories3m"))
    ap.add_argument("--text", default=os.path.join(SHARED, "data", "stories-heldout.txt"))
    ap.add_argument("--max-paragraphs", type=int, default=None)
    ap.add_argument("--dtypes", nargs="+", default=["auto", "int8", "fp8_e4m3"])
    args = ap.parse_args()
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    rows = kv_perplexities(args.model, text, args.dtypes, args.max_paragraphs)
    print_table(rows, "held-out perplexity by KV-cache dtype (stories3m, fp32 weights)")
    write_json(os.path.join(_HERE, "results", "kv_cache_ppl.json"),
               {"model": args.model, "text": args.text, "rows": rows})
    worst = max(abs(r["ppl_change_pct"]) for r in rows)
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
