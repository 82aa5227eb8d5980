"""Held-out perplexity with a quantized KV cache, per model (docs/kv-cache.md).

For each model and ``--kv-cache-dtype`` (``auto``: the fp32 cache, ``bfloat16``: a 2-byte one
rounded to nearest even, no scales; ``int8``, ``fp8_e4m3``):
nybble's own model (float32, CPU, the torch reference attention), the scales calibrated as the
engine does at start-up (:func:`nybble.runtime.worker.kv_calibration.calibrate_kv_scales`: keys
cached before RoPE and smoothed per channel), against keys smoothed after RoPE and plain
per-head key scales, scored by ``nybble eval-ppl``'s protocol (every story with BOS, windows
of 512 tokens advancing by 256).
Prefill reads the keys and values back from the quantized cache, so every attention score of
the text goes through the quantization. Also prints the pool-size ratio: tokens a 256 MiB pool
holds with each dtype. Writes ``benchmarks/results/kv_cache_ppl.json``.

Exits 1 when an engine-calibrated (``pre-rope``) row is 1% or more off the fp32 cache.

Run: ``python benchmarks/kv_cache_ppl.py [--model DIR ...] [--max-paragraphs N]``.
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
from nybble.quantize.eval_ppl import nybble_model, perplexity, split_paragraphs  # noqa: E402
from nybble.runtime.worker.kv_plan import kv_storage_dtype, plan_kv_cache  # noqa: E402
from nybble.runtime.worker.kv_calibration import calibrate_kv_scales  # noqa: E402

KEY_SCHEMES = {"pre-rope": {"smooth_keys": True, "pre_rope": True},
               "post-rope": {"smooth_keys": True, "pre_rope": False},
               "per-head": {"smooth_keys": False}}
"""The key schemes compared (``calibrate_kv_scales`` arguments); the first is the engine's."""

SHARED = os.environ.get("NYBBLE_SHARED", os.path.join(os.path.dirname(_HERE), "..", "shared"))


def _install(loaded, state: list | None) -> None:
    """Put one calibration's ``(kv_scale, key_smoothing, rotary_keys)`` per layer on the
    layers (``None``: the float cache)."""
    for i, layer in enumerate(loaded.model.layers):
        layer.self_attn.kv_scale, layer.self_attn.key_smoothing, layer.self_attn.rotary_keys = \
            (None, None, None) if state is None else state[i]
    loaded.model.drop_ops()


@torch.no_grad()
def _mean_kl(loaded, tok, paras: list[str], states: dict, device) -> dict:
    """Mean KL divergence (nats per token) of each state's next-token distribution from the
    float cache's, over the first 512 tokens of every paragraph: unlike a perplexity change,
    which sums signed log-probability shifts that partly cancel, it only grows with the
    distortion the cache adds."""
    totals, count = {key: 0.0 for key in states}, 0
    for p in paras:
        ids = tok(p)["input_ids"][:512]
        _install(loaded, None)
        ref = prefill_logits(loaded, [ids], device)[0].double().log_softmax(-1)
        for key, (cache_dtype, state) in states.items():
            _install(loaded, state)
            out = prefill_logits(loaded, [ids], device, cache_dtype)[0].double().log_softmax(-1)
            totals[key] += float((ref.exp() * (ref - out)).sum())
        count += len(ids)
    return {key: total / count for key, total in totals.items()}


def kv_perplexities(model_dir: str, text: str, dtypes: list[str],
                    max_paragraphs: int | None = None) -> list[dict]:
    """One row per KV dtype and key scheme: perplexity, its change against ``auto``, the mean
    next-token KL divergence from ``auto``, pool tokens. Each quantized dtype is scored three
    ways: the engine's calibration (keys cached before RoPE, smoothed per channel:
    ``pre-rope``), keys smoothed after RoPE (``post-rope``, nybble's former method) and plain
    per-head key scales (``per-head``, the one before)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    loaded, _ = nybble_model(model_dir)
    device = torch.device("cpu")
    attns = [layer.self_attn for layer in loaded.model.layers]
    states: dict = {}
    for name in dtypes:
        cache_dtype = kv_storage_dtype(name, loaded.dtype)
        unscaled = name in ("auto", "bfloat16")   # float caches: no scales to calibrate
        for keys in (["float"] if unscaled else list(KEY_SCHEMES)):
            if unscaled:
                state = None
            else:
                calibrate_kv_scales(loaded, cache_dtype, device, **KEY_SCHEMES[keys])
                state = [(a.kv_scale, a.key_smoothing, a.rotary_keys) for a in attns]
            states[(name, keys)] = (cache_dtype, state)
    rows = []
    for (name, keys), (cache_dtype, state) in states.items():
        _install(loaded, state)
        ppl = perplexity(lambda ids: prefill_logits(loaded, [ids], device, cache_dtype)[0],
                         tok, text, max_paragraphs=max_paragraphs)
        spec = plan_kv_cache(CacheConfig(kv_cache_dtype=name), loaded.shape, loaded.dtype,
                             device)
        rows.append({"model": os.path.basename(os.path.normpath(model_dir)),
                     "kv_cache_dtype": name, "keys": keys,
                     "perplexity": round(ppl["perplexity"], 5),
                     "tokens_scored": int(ppl["tokens"]),
                     "pool_tokens_256MiB": spec.num_blocks * spec.block_size})
    kl = _mean_kl(loaded, tok, split_paragraphs(text, max_paragraphs), states, device)
    base = rows[0]
    for r in rows:
        r["ppl_change_pct"] = round((r["perplexity"] / base["perplexity"] - 1) * 100, 3)
        r["kl_nats_per_token"] = float(f"{kl[(r['kv_cache_dtype'], r['keys'])]:.3e}")
        r["pool_ratio"] = round(r["pool_tokens_256MiB"] / base["pool_tokens_256MiB"], 3)
    _install(loaded, None)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=[
        os.path.join(os.path.dirname(_HERE), "nybble", "_bundled", "stories260k"),
        os.path.join(SHARED, "models", "stories3m")],
        help="HF model folders (SmolLM2: the float32 folder of benchmarks/smollm2_artifacts.sh)")
    ap.add_argument("--text", default=os.path.join(SHARED, "data", "stories-heldout.txt"))
    ap.add_argument("--max-paragraphs", type=int, default=40,
                    help="score the first N held-out stories (0: all)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "int8", "fp8_e4m3"])
    ap.add_argument("--out", default=os.path.join(_HERE, "results", "kv_cache_ppl.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    rows = []
    for model in args.model:
        rows += kv_perplexities(model, text, args.dtypes, args.max_paragraphs or None)
        print_table(rows, "held-out perplexity by KV-cache dtype (fp32 weights)")
    write_json(args.out, {"models": args.model, "text": args.text,
                          "max_paragraphs": args.max_paragraphs, "rows": rows})
    worst = max(abs(r["ppl_change_pct"]) for r in rows if r["keys"] in ("float", "pre-rope"))
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
