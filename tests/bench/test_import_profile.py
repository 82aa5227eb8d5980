"""``-X importtime`` parsing and summing (nybble.bench.import_profile) against a hand-written
report and against CPython's own output."""
from __future__ import annotations

import subprocess
import sys

import pytest

from nybble.bench.import_profile import (
    ImportRecord,
    import_chain,
    parse_importtime,
    summarize_imports,
)

REPORT = """\
import time: self [us] | cumulative | imported package
12:00:01 INFO some log line between the imports
import time:       100 |        100 |     c.inner
import time:       200 |        300 |   c
import time:        50 |         50 |   d
import time:      1000 |       1350 | a
import time:      2000 |       2000 | torch
import time:         7 |          7 |     torch.distributed
import time:         3 |         10 |   torch.utils
import time:        40 |         50 | b
"""


def test_parse_reads_names_times_and_depths() -> None:
    records = parse_importtime(REPORT.splitlines())
    assert records[:4] == [ImportRecord("c.inner", 100, 100, 2), ImportRecord("c", 200, 300, 1),
                           ImportRecord("d", 50, 50, 1), ImportRecord("a", 1000, 1350, 0)]
    assert [r.name for r in records[4:]] == ["torch", "torch.distributed", "torch.utils", "b"]
    assert import_chain(records, "c.inner") == ["c", "a"]
    assert import_chain(records, "torch.distributed") == ["torch.utils", "b"]
    assert import_chain(records, "a") == []
    assert import_chain(records, "missing") == []


def test_summary_sums_self_times() -> None:
    summary = summarize_imports(parse_importtime(REPORT.splitlines()), top=2)
    assert summary["total_s"] == pytest.approx((100 + 200 + 50 + 1000 + 2000 + 7 + 3 + 40) / 1e6)
    assert summary["modules"] == 8
    assert summary["by_package"] == {"torch": 0.00201, "a": 0.001}
    assert summary["top_self"] == {"torch": 0.002, "a": 0.001}
    assert summary["top_cumulative"] == {"torch": 0.002, "a": 0.00135}
    assert summary["loaded"]["torch.distributed"] == "torch.distributed <- torch.utils <- b"
    assert summary["loaded"]["torch"] == "torch"
    assert summary["loaded"]["sympy"] is None


def test_malformed_line_is_an_error() -> None:
    with pytest.raises(ValueError, match="self | cumulative | name"):
        parse_importtime(["import time: 12 | json"])


def test_cpython_report_parses_and_adds_up() -> None:
    # CPython prints self = cumulative - the children's cumulative, each rounded up to 1 us
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import json"],
                          capture_output=True, text=True, check=True, timeout=60)
    records = parse_importtime(proc.stderr.splitlines())
    i = next(i for i, r in enumerate(records) if r.name == "json")
    top = records[i]
    assert top.depth == 0
    children: list[ImportRecord] = []
    for r in reversed(records[:i]):
        if r.depth <= top.depth:
            break
        if r.depth == top.depth + 1:
            children.append(r)
    assert "json.decoder" in {c.name for c in children}
    assert abs(top.cumulative_us - top.self_us - sum(c.cumulative_us for c in children)) \
        <= len(children) + 1
