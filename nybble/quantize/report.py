"""Write ``quantization_report.json`` and the output folder's ``README.md`` (schema and reader:
:mod:`nybble.quant.report`).

The per-layer figure is the relative output error on the calibration inputs ``X`` the layer
saw, ``||X W^T - X Q^T||_F / ||X W^T||_F``, computed from ``H = X^T X`` as
``sqrt(tr(D H D^T) / tr(W H W^T))`` with ``D = W - Q`` (float64).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from nybble import __version__
from nybble.quant.report import REPORT_FILE, SCHEMA_VERSION, report_path


def text_sha256(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def relative_output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """``||X W^T - X Q^T||_F / ||X W^T||_F`` from ``W, Q [N, K]`` and ``H = X^T X [K, K]``
    (any positive multiple of it)."""
    w64, h64 = w.double(), h.double()
    d = w64 - q.double()
    num = float(((d @ h64) * d).sum())
    den = float(((w64 @ h64) * w64).sum())
    return (max(num, 0.0) / den) ** 0.5 if den > 0 else 0.0


def safetensors_bytes(model_dir: str) -> int:
    """Total size of the ``*.safetensors`` weight files of a folder (bytes)."""
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
               if f.endswith(".safetensors") and not f.startswith("reference_outputs"))


def checkpoint_tensor_bytes(model_dir: str, names: list[str]) -> int:
    """Bytes the tensors ``names`` take in ``model_dir``'s safetensors files (their stored
    dtype; names not found count 0)."""
    from safetensors import safe_open

    want, total = set(names), 0
    for f in sorted(os.listdir(model_dir)):
        if not f.endswith(".safetensors") or f.startswith("reference_outputs"):
            continue
        with safe_open(os.path.join(model_dir, f), framework="pt") as st:
            for k in st.keys():
                if k in want:
                    sl = st.get_slice(k)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    total += n * _DTYPE_BYTES[sl.get_dtype()]
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}


def build_report(settings: dict[str, Any], calibration: dict[str, Any] | None,
                 layer_errors: dict[str, float | None], skipped: dict[str, str],
                 bytes_: dict[str, int], wall_time_s: float,
                 perplexity: dict[str, Any] | None) -> dict[str, Any]:
    """The report dict (schema in :mod:`nybble.quant.report`); ``settings`` holds method,
    bits, group_size, sym, desc_act, static_groups, threads and the written
    quantization_config."""
    return {"schema_version": SCHEMA_VERSION, "nybble_version": __version__, **settings,
            "calibration": calibration,
            "layers": {k: {"relative_output_error": v} for k, v in sorted(layer_errors.items())},
            "skipped": dict(sorted(skipped.items())), "bytes": bytes_,
            "wall_time_s": round(wall_time_s, 3), "perplexity": perplexity}


def _readme(r: dict[str, Any]) -> str:
    gs = r["group_size"]
    lines = [f"# {r['method']} {r['bits']}-bit {'per-channel' if gs == -1 else f'g{gs}'}",
             "", f"Quantized by nybble {r['nybble_version']} (`nybble quantize`); the full "
             f"report is `{REPORT_FILE}`.", "", "| | before | after |", "| --- | --- | --- |"]
    by = r["bytes"]
    lines.append(f"| quantized linear weights (bytes) | {by['linear_before']:,} | "
                 f"{by['linear_after']:,} |")
    lines.append(f"| checkpoint files (bytes) | {by['checkpoint_before']:,} | "
                 f"{by['checkpoint_after']:,} |")
    ppl = r.get("perplexity")
    if ppl:
        lines.append(f"| perplexity on `{ppl['text']}` ({int(ppl['tokens']):,} tokens) | "
                     f"{ppl['before']:.4f} | {ppl['after']:.4f} |")
    cal = r.get("calibration")
    lines += ["", f"Calibration: {cal['tokens']:,} tokens in {cal['sequences']} sequences of "
              f"{cal['seq_len']} from `{cal['source']}` (sha256 `{cal['sha256'][:16]}`)"
              + (f"; the method needs {cal['tokens_needed']:,}." if cal.get("tokens_needed")
                 else ".")
              if cal else "Calibration: none.",
              f"Quantization wall time: {r['wall_time_s']:.1f} s "
              f"({r.get('threads', 1)} torch thread(s)).", ""]
    errs = {k: v["relative_output_error"] for k, v in r["layers"].items()}
    by_kind: dict[str, list[float]] = {}
    for k, v in errs.items():
        if v is not None:
            by_kind.setdefault(k.rsplit(".", 1)[-1], []).append(v)
    if by_kind:
        lines += ["Relative output error on the calibration inputs, per projection "
                  "(mean / max over layers):", "", "| projection | mean | max |",
                  "| --- | --- | --- |"]
        lines += [f"| {kind} | {sum(v) / len(v):.2%} | {max(v):.2%} |"
                  for kind, v in sorted(by_kind.items())]
    if r["skipped"]:
        lines += ["", f"Left dense: {len(r['skipped'])} linear layer(s) (see the report)."]
    return "\n".join(lines) + "\n"


def write_report(out_dir: str, report: dict[str, Any]) -> None:
    """Write ``quantization_report.json`` and ``README.md`` into ``out_dir``; for a GGUF
    file ``out_dir`` (``NAME.gguf``), only the report, beside it as
    ``NAME.quantization_report.json`` (:func:`nybble.quant.report.report_path`)."""
    with open(report_path(out_dir), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    if out_dir.lower().endswith(".gguf"):
        return
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(_readme(report))
