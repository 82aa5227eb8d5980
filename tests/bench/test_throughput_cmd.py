"""``nybble bench throughput`` end to end on a few requests (both backends, two caps)."""
from __future__ import annotations

import json

from tests.bench.helpers import bench_main, plot_module

_BACKEND_FIELDS = {"backend", "elapsed_s", "num_requests", "prompt_tokens", "output_tokens",
                   "num_steps", "kv_waste_mean", "kv_waste_peak", "extra", "requests_per_s",
                   "output_tokens_per_s", "total_tokens_per_s", "elapsed_s_runs"}


def test_throughput_both_backends(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "tp.json"
    rc = bench_main(["bench", "throughput", "--num-prompts", "6", "--context-budget", "64",
                     "--sweep-max-num-seqs", "2,4", "--threads", "1", "--output", str(out)])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert {"meta", "benchmark", "model", "config", "workload", "results"} <= payload.keys()
    expected = payload["workload"]["total_output_tokens"]
    assert [r["max_num_seqs"] for r in payload["results"]] == [2, 4]
    for res in payload["results"]:
        assert set(res["ratio"]) == {"requests_per_s", "output_tokens_per_s",
                                     "total_tokens_per_s"}
        for backend in ("nybble", "hf"):
            r = res[backend]
            assert _BACKEND_FIELDS <= r.keys()
            assert r["output_tokens"] == expected and r["num_requests"] == 6
            assert 0.0 <= r["kv_waste_mean"] <= r["kv_waste_peak"] <= 1.0
        assert res["nybble"]["extra"]["peak_num_seqs_in_step"] <= res["max_num_seqs"]
    table = capsys.readouterr().out
    assert "nybble/hf" in table and "kv_waste_mean" in table

    assert plot_module().main(["--throughput", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_throughput_nybble_only_fixed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "tp.json"
    assert bench_main(["bench", "throughput", "--backend", "nybble", "--workload", "fixed",
                       "--input-len", "10", "--output-len", "5", "--num-prompts", "3",
                       "--no-warmup", "--output", str(out)]) == 0
    res = json.loads(out.read_text())["results"][0]
    assert "hf" not in res and "ratio" not in res
    assert res["nybble"]["output_tokens"] == 15
