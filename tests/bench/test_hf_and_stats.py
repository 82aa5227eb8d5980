"""The Hugging Face baseline and the waste / latency bookkeeping (no nybble engine needed)."""
from __future__ import annotations

import pytest

from nybble.bench.report import summarize
from nybble.bench.serve_client import RequestRecord, aggregate, arrival_offsets
from nybble.bench.stats import WasteTracker
from nybble.bench.workloads import WorkloadConfig, build_requests
from nybble.config import DEFAULT_MODEL


def test_hf_counts_exactly_the_requested_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from nybble.bench.hf_runner import load_hf_model, run_hf

    reqs = build_requests(WorkloadConfig(num_requests=5, context_budget=64), tokenizer)
    res = run_hf(load_hf_model(DEFAULT_MODEL, "auto"), reqs, max_batch_size=2)
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert res.num_requests == 5 and res.extra["num_batches"] == 3
    assert 0.0 <= res.kv_waste_mean <= res.kv_waste_peak <= 1.0  # type: ignore[operator]
    assert res.extra["tokens_generated_incl_padding_waits"] >= res.output_tokens


def test_hf_waste_is_zero_for_equal_lengths(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from nybble.bench.hf_runner import load_hf_model, run_hf

    reqs = build_requests(WorkloadConfig(kind="fixed", num_requests=2, input_len=8,
                                         output_len=4, context_budget=64), tokenizer)
    res = run_hf(load_hf_model(DEFAULT_MODEL, "auto"), reqs, max_batch_size=2)
    assert res.kv_waste_peak == pytest.approx(0.0)
    assert res.num_steps == 4


def test_waste_tracker() -> None:
    t = WasteTracker()
    assert t.mean is None
    t.add(3, 4)
    t.add(4, 4)
    t.add(0, 0)  # nothing allocated: skipped
    assert t.mean == pytest.approx(0.125) and t.peak == pytest.approx(0.25)
    with pytest.raises(AssertionError):
        t.add(5, 4)


def test_arrivals_and_aggregate() -> None:
    assert (arrival_offsets(4, float("inf"), 0) == 0).all()
    off = arrival_offsets(1000, 10.0, 0)
    assert off[0] == 0 and (off[1:] >= off[:-1]).all() and 80 < off[-1] < 120
    recs = [RequestRecord(10, 5, True, "", 0.1, 0.5, [0.1] * 4, 5),
            RequestRecord(10, 3, False, "HTTP 500")]
    res = aggregate(recs, 2.0)
    assert res["completed"] == 1 and res["failed"] == 1 and res["errors"] == ["HTTP 500"]
    assert res["tpot_mean_ms"] == pytest.approx(100.0)
    assert res["output_throughput"] == pytest.approx(2.5)
    assert summarize([], "x") == {"x_mean_ms": None, "x_median_ms": None, "x_p90_ms": None,
                                  "x_p99_ms": None}
