"""Where a process's start-up goes: CPython's ``-X importtime`` report, parsed and summed.

``python -X importtime`` (or ``PYTHONPROFILEIMPORTTIME=1``) writes one stderr line per
imported module, after the module (and everything it imported) has finished::

    import time: self [us] | cumulative | imported package
    import time:       117 |        117 |   _io
    import time:      1496 |       2303 | json

``self`` is the module's own execution time, ``cumulative`` adds its imports; the indentation
(two spaces per level) is the nesting at the moment it was imported, so a module's parent is the
next line below it with a smaller indentation. Summing ``self`` over every line gives the time
the process spent importing. Used by ``benchmarks/startup_imports.py``.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_PREFIX = "import time:"

WATCHED = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils", "sympy",
           "xgrammar", "jsonschema", "prometheus_client", "fastapi", "jinja2", "tokenizers",
           "numpy", "nybble.bench")
"""Modules whose presence a start-up report states (heavy, or only needed by some requests)."""


@dataclass(frozen=True)
class ImportRecord:
    """One ``-X importtime`` line.

    Attributes:
        name: the module's dotted name.
        self_us: time spent in the module's own body (microseconds).
        cumulative_us: ``self_us`` plus the modules it imported (microseconds).
        depth: nesting level at import (0: imported by the program itself, or lazily from a
            function).
    """

    name: str
    self_us: int
    cumulative_us: int
    depth: int


def parse_importtime(lines: Iterable[str]) -> list[ImportRecord]:
    """The records of the ``import time:`` lines among ``lines`` (other lines are skipped, so a
    log that mixes them with importtime output is fine), in output order.

    Raises:
        ValueError: an ``import time:`` line that is not ``self | cumulative | name``.
    """
    records = []
    for line in lines:
        if not line.startswith(_PREFIX) or "self [us]" in line:
            continue
        parts = line[len(_PREFIX):].rstrip("\n").split("|")
        if len(parts) != 3:
            raise ValueError(f"importtime line must be 'self | cumulative | name', got {line!r}")
        name = parts[2]
        stripped = name.lstrip(" ")
        # NOTE: one space follows the '|', then two per nesting level
        records.append(ImportRecord(stripped, int(parts[0]), int(parts[1]),
                                    (len(name) - len(stripped) - 1) // 2))
    return records


def import_chain(records: list[ImportRecord], name: str) -> list[str]:
    """Who imported ``name`` first: its parent, the parent's parent, ... up to depth 0
    (empty when ``name`` was imported at depth 0 or not at all)."""
    for i, rec in enumerate(records):
        if rec.name != name:
            continue
        chain, depth = [], rec.depth
        for later in records[i + 1:]:
            if later.depth < depth:
                chain.append(later.name)
                depth = later.depth
        return chain
    return []


def summarize_imports(records: list[ImportRecord], top: int = 12) -> dict[str, Any]:
    """A start-up's import summary (seconds).

    Returns:
        ``total_s`` (sum of ``self``), ``modules`` (count), ``by_package`` (top-level package
        -> summed ``self``, the ``top`` largest), ``top_self`` (the ``top`` modules with the
        largest own time), ``top_cumulative`` (the ``top`` largest imports made at depth 0:
        what the program or a lazy import asked for), and ``loaded`` (each :data:`WATCHED`
        module -> the chain of imports that pulled it in, ``None`` when not imported).
    """
    by_package: dict[str, int] = defaultdict(int)
    for rec in records:
        by_package[rec.name.split(".")[0]] += rec.self_us
    names = {rec.name for rec in records}
    roots = [r for r in records if r.depth == 0]
    return {
        "total_s": _s(sum(r.self_us for r in records)),
        "modules": len(records),
        "by_package": {k: _s(v) for k, v in sorted(by_package.items(),
                                                   key=lambda kv: -kv[1])[:top]},
        "top_self": {r.name: _s(r.self_us)
                     for r in sorted(records, key=lambda r: -r.self_us)[:top]},
        "top_cumulative": {r.name: _s(r.cumulative_us)
                           for r in sorted(roots, key=lambda r: -r.cumulative_us)[:top]},
        "loaded": {m: _chain_text(records, m) if m in names else None for m in WATCHED},
    }


def _chain_text(records: list[ImportRecord], name: str) -> str:
    """``name <- parent <- ... <- root``, the middle elided past 4 parents."""
    chain = import_chain(records, name)
    if len(chain) > 5:
        chain = [*chain[:4], "...", chain[-1]]
    return " <- ".join([name, *chain])


def _s(us: int) -> float:
    return round(us / 1e6, 6)
