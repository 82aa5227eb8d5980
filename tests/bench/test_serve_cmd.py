"""``nybble bench serve`` end to end: launch ``nybble serve``, stream a few requests."""
from __future__ import annotations

import json

import pytest

from tests.bench.helpers import bench_main, plot_module

pytestmark = [pytest.mark.server, pytest.mark.slow]

_RUN_FIELDS = {"request_rate", "max_concurrency", "completed", "failed", "duration_s",
               "total_input_tokens", "total_output_tokens", "requested_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput", "errors"}


def test_serve_two_rates_no_failures(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "serve.json"
    # NOTE: eager and 128-token budgets: on the fused CPU step a few-token request can end
    # within one read of its stream (its deltas merged into one chunk: no ITL to report)
    rc = bench_main(["bench", "serve", "--num-prompts", "5", "--context-budget", "128",
                     "--request-rate", "20,inf", "--max-concurrency", "3",
                     "--serve-args", "--max-num-seqs 4 --disable-log-stats --enforce-eager",
                     "--output", str(out)])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert {"meta", "benchmark", "model", "served_model", "config", "workload", "runs"} \
        <= payload.keys()
    assert [r["request_rate"] for r in payload["runs"]] == [20.0, float("inf")]
    for run in payload["runs"]:
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p90", "p99"):
                assert run[f"{metric}_{stat}_ms"] is not None
        assert _RUN_FIELDS <= run.keys()
        assert run["failed"] == 0 and run["completed"] == 5 and run["errors"] == []
        assert run["total_output_tokens"] == run["requested_output_tokens"] \
            == payload["workload"]["total_output_tokens"]
    assert "ttft_p99" in capsys.readouterr().out

    assert plot_module().main(["--serve", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "serve-latency.png").stat().st_size > 0
