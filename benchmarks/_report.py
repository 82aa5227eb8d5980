"""Shared benchmark output (re-exported from :mod:`nybble.bench.report`, where it now lives)."""
from __future__ import annotations

from nybble.bench.report import machine_meta, print_table, summarize, write_json

__all__ = ["machine_meta", "print_table", "summarize", "write_json"]
