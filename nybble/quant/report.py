"""The quality report that ``nybble quantize`` writes beside a checkpoint, read back here.

``quantization_report.json`` (schema version 1) holds: ``method``, ``bits``, ``group_size``,
``sym``, ``desc_act``; ``calibration`` (``source``, ``sha256`` of the text, ``sequences``,
``seq_len``, ``tokens``); ``layers`` (per quantized Linear: ``relative_output_error`` =
``||X W^T - X Q^T||_F / ||X W^T||_F`` on the calibration inputs ``X`` it saw); ``skipped``
(Linears left dense, with the reason); ``bytes`` (``linear_before`` / ``linear_after``: the
quantized Linears' weights in the source dtype and packed; ``checkpoint_before`` /
``checkpoint_after``: the safetensors files); ``wall_time_s`` (quantization, seconds);
``perplexity`` (``before`` / ``after`` on ``text`` when ``--eval-text`` was given, else null);
``nybble_version``. This module only reads it (the formats floor: the server can log it
without importing the quantizers).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

REPORT_FILE = "quantization_report.json"
"""File name of the report inside a model folder."""
SCHEMA_VERSION = 1


def report_path(model: str) -> str:
    """Where the report of ``model`` lives: ``REPORT_FILE`` inside a model folder;
    ``NAME.quantization_report.json`` beside a ``NAME.gguf`` file (``nybble quantize --format
    gguf``)."""
    if model.lower().endswith(".gguf"):
        return f"{model[:-len('.gguf')]}.{REPORT_FILE}"
    return os.path.join(model, REPORT_FILE)


def read_report(model_dir: str) -> dict[str, Any] | None:
    """The parsed report of ``model_dir`` (a folder or a ``.gguf`` file,
    :func:`report_path`), or None when there is none.

    Raises:
        ValueError: the file exists but is not a JSON object of a known schema version.
    """
    path = report_path(model_dir)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} must be a JSON report, got an unreadable file: {e}") from e
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} must have schema_version {SCHEMA_VERSION}, got {version!r}")
    return data


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def summarize_report(model_dir: str) -> str | None:
    """One line for start-up logs from ``model_dir``'s report, or None without a report.

    Example: ``"quantized by nybble 0.1.0: awq 4-bit g128, calibration 23,040 tokens of
    calib.txt (sha256 3f1c2a9b), held-out perplexity 4.4220 -> 4.4601 (+0.86%), linear weights 12.0 MiB ->
    1.6 MiB, worst layer output error 4.1% (model.layers.3.mlp.down_proj)"``.

    A malformed report is logged as a warning and gives None: a start-up log line is not a
    reason to refuse to serve.
    """
    try:
        r = read_report(model_dir)
        if r is None:
            return None
        gs = r["group_size"]
        parts = [f"quantized by nybble {r.get('nybble_version', '?')}: {r['method']} "
                 f"{r['bits']}-bit {'per-channel' if gs == -1 else f'g{gs}'}"]
        cal = r.get("calibration")
        if cal:
            src = cal.get("source", "")
            where = ("sampled from the model" if src.startswith("sampled from the model") else
                     f"of {os.path.basename(src)}" if src else "")
            parts.append(f"calibration {cal['tokens']:,} tokens {where} "
                         f"(sha256 {cal['sha256'][:8]})".replace("  ", " "))
        ppl = r.get("perplexity")
        if ppl:
            b, a = ppl["before"], ppl["after"]
            parts.append(f"held-out perplexity {b:.4f} -> {a:.4f} ({(a / b - 1) * 100:+.2f}%)")
        by = r["bytes"]
        parts.append(f"linear weights {_mib(by['linear_before'])} -> {_mib(by['linear_after'])}")
        errs = {k: v["relative_output_error"] for k, v in r.get("layers", {}).items()
                if v.get("relative_output_error") is not None}
        if errs:
            worst = max(errs, key=lambda k: errs[k])
            parts.append(f"worst layer output error {errs[worst] * 100:.1f}% ({worst})")
        return ", ".join(parts)
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring the quantization report of %s: %s", model_dir, e)
        return None
