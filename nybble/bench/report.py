"""Shared benchmark output: print one readable table and write the same rows as JSON."""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Any

import numpy as np


def print_table(rows: list[dict[str, Any]], title: str = "") -> str:
    """Format ``rows`` (dicts with the same keys) as an aligned text table, print and return it."""
    if not rows:
        return ""
    keys = list(rows[0].keys())
    cells = [[_fmt(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = [title] if title else []
    lines.append("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    if v is None:
        return "-"
    return str(v)


def machine_meta() -> dict[str, Any]:
    """Host facts recorded next to every result (python, CPU count, torch threads, time)."""
    meta: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "processor": platform.processor(), "cpu_count": os.cpu_count(),
                            "unix_time": time.time()}
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
    except ImportError:  # the serve client does not need torch
        pass
    return meta


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` plus machine metadata (host, python, time) as indented JSON."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": machine_meta(), **payload}, f, indent=2)


def summarize(values_s: list[float] | np.ndarray, prefix: str,
              percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Mean / median / percentiles of latencies given in seconds, returned in milliseconds.

    Keys: ``{prefix}_mean_ms``, ``{prefix}_median_ms``, ``{prefix}_p90_ms``, ... (``None``
    when ``values_s`` is empty).
    """
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, float | None] = {f"{prefix}_mean_ms": float(arr.mean()) if arr.size else None}
    for p in percentiles:
        key = f"{prefix}_median_ms" if p == 50 else f"{prefix}_p{p}_ms"
        out[key] = float(np.percentile(arr, p)) if arr.size else None
    return out
