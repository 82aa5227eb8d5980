"""Draw the benchmark charts (PNG) from the JSON files the ``nybble bench`` commands write.

    python benchmarks/plot.py --throughput benchmarks/results/throughput-*.json \
        --serve benchmarks/results/serve-*.json --out benchmarks/results

* ``throughput.png``: output tokens/s against the batch cap (``max_num_seqs``), one panel per
  model, one line per backend (nybble, Hugging Face static batching).
* ``serve-latency.png``: TTFT and TPOT percentiles (p50, p90, p99) against the request rate,
  one line pair per serve JSON file.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


@dataclass(frozen=True)
class PlotConfig:
    """Inputs and output folder of the plots (paths)."""

    throughput: tuple[str, ...] = ()
    serve: tuple[str, ...] = ()
    out: str = "benchmarks/results"


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _model_label(payload: dict[str, Any]) -> str:
    return os.path.basename(os.path.normpath(payload["model"]))


def plot_throughput(paths: tuple[str, ...], out_png: str) -> None:
    """Output tokens/s vs batch cap, one panel per model (files of the same model merge)."""
    by_model: dict[str, dict[str, dict[int, float]]] = {}
    for path in paths:
        payload = _load(path)
        series = by_model.setdefault(_model_label(payload), {})
        for res in payload["results"]:
            for backend in ("nybble", "hf"):
                if backend in res:
                    series.setdefault(backend, {})[res["max_num_seqs"]] = \
                        res[backend]["output_tokens_per_s"]
    fig, axes = plt.subplots(1, len(by_model), figsize=(5.5 * len(by_model), 4), squeeze=False)
    for ax, (model, series) in zip(axes[0], sorted(by_model.items())):
        for backend, pts in sorted(series.items(), reverse=True):
            caps = sorted(pts)
            label = "nybble (continuous batching)" if backend == "nybble" else \
                "HF generate (static batches)"
            ax.plot(caps, [pts[c] for c in caps], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch cap (max_num_seqs)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Offline throughput, mixed-length requests (CPU)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def plot_serve(paths: tuple[str, ...], out_png: str) -> None:
    """TTFT and TPOT p50/p90/p99 (ms) vs request rate (``inf`` drawn right of the last rate)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        payload = _load(path)
        runs = sorted(payload["runs"], key=lambda r: r["request_rate"])
        finite = [r["request_rate"] for r in runs if math.isfinite(r["request_rate"])]
        inf_x = (max(finite) * 1.5) if finite else 1.0
        xs = [r["request_rate"] if math.isfinite(r["request_rate"]) else inf_x for r in runs]
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for pct, style in (("median", "-"), ("p90", "--"), ("p99", ":")):
                ys = [r[f"{metric}_{pct}_ms"] for r in runs]
                ax.plot(xs, ys, style, marker="o",
                        label=f"{payload['served_model']} {pct.replace('median', 'p50')}")
    for ax, metric in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("request rate (req/s; rightmost point = all at once)")
        ax.set_ylabel(f"{metric} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Online serving latency (streaming /v1/completions, CPU)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, draw the requested charts, print the PNG paths."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    parser.add_argument("--throughput", nargs="*", default=None,
                        help="bench throughput JSONs (default: results/throughput-*.json)")
    parser.add_argument("--serve", nargs="*", default=None,
                        help="bench serve JSONs (default: results/serve-*.json)")
    parser.add_argument("--out", default=results, help="folder for the PNGs")
    args = parser.parse_args(argv)
    if args.throughput is None:
        args.throughput = sorted(glob.glob(os.path.join(results, "throughput-*.json")))
    if args.serve is None:
        args.serve = sorted(glob.glob(os.path.join(results, "serve-*.json")))
    cfg = PlotConfig(tuple(args.throughput), tuple(args.serve), args.out)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.throughput:
        plot_throughput(cfg.throughput, os.path.join(cfg.out, "throughput.png"))
        print(os.path.join(cfg.out, "throughput.png"))
    if cfg.serve:
        plot_serve(cfg.serve, os.path.join(cfg.out, "serve-latency.png"))
        print(os.path.join(cfg.out, "serve-latency.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
