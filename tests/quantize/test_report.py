"""``quantization_report.json`` + README.md beside every checkpoint, checked against
independent recomputations: the calibration hash, a layer's output error from its own inputs,
byte counts from the files, perplexities from ``eval-ppl`` on each folder; and the one-line
summary the server logs."""
from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from nybble.config import DEFAULT_MODEL
from nybble.quant.report import REPORT_FILE, read_report, summarize_report
from nybble.quantize.calibration import calibration_ids
from nybble.quantize.driver import QuantizeOptions, quantize_model
from nybble.quantize.eval_ppl import nybble_logits_fn, perplexity
from nybble.quantize.hf_model import load_model

CALIB = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the sun. One day she saw a big red ball in the park and ran to get it.\n\n") * 12
EVAL = ("Tom and Sue went to the park. They saw a big dog. The dog was happy.\n\n"
        "The cat sat on the mat. It was a sunny day and the cat was warm.")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("report") / "gptq")
    opts = QuantizeOptions(method="gptq", bits=4, group_size=32, calib_text=CALIB,
                           allow_unquantized=True,
                           calib_source="calib.txt", num_samples=4, seq_len=64,
                           eval_text=EVAL, eval_source="eval.txt")
    return out, quantize_model(DEFAULT_MODEL, out, opts, progress=False)


def test_report_fields(quantized: tuple[str, dict]) -> None:
    out, summary = quantized
    r = read_report(out)
    assert r is not None and r == json.load(open(os.path.join(out, REPORT_FILE)))
    assert (r["method"], r["bits"], r["group_size"], r["sym"]) == ("gptq", 4, 32, False)
    assert r["quantization_config"] == summary["config"]
    cal = r["calibration"]
    assert cal["sha256"] == hashlib.sha256(CALIB.encode()).hexdigest()
    assert cal["source"] == "calib.txt" and cal["tokens"] == cal["sequences"] * cal["seq_len"]
    assert set(r["layers"]) == set(summary["quantized"]) and len(r["layers"]) == 20
    assert all(0 < v["relative_output_error"] < 0.5 for v in r["layers"].values())
    assert set(r["skipped"]) == set(summary["skipped"])
    assert r["wall_time_s"] > 0 and r["threads"] == 1


def test_layer_error_from_its_inputs(quantized: tuple[str, dict]) -> None:
    """Layer 0's first GPTQ sub-group sees the fp model's inputs: recompute
    ||XW^T - XQ^T|| / ||XW^T|| with X captured from transformers, Q from the written file."""
    out, _ = quantized
    name = "model.layers.0.self_attn.q_proj"
    fp = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ids = calibration_ids(AutoTokenizer.from_pretrained(DEFAULT_MODEL), CALIB, 4, 64,
                          fp.config.bos_token_id)
    seen: list[torch.Tensor] = []
    lin = fp.get_submodule(name)
    h = lin.register_forward_hook(lambda _m, args, _o: seen.append(args[0].detach()))
    with torch.no_grad():
        fp(ids)
    h.remove()
    x = seen[0].reshape(-1, lin.in_features).double()
    w = lin.weight.detach().double()
    q = load_model(out).get_submodule(name).dequantized_weight().double()
    expect = float((x @ (w - q).t()).norm() / (x @ w.t()).norm())
    got = read_report(out)["layers"][name]["relative_output_error"]
    assert got == pytest.approx(expect, rel=1e-5)


def test_bytes_and_perplexity(quantized: tuple[str, dict]) -> None:
    out, summary = quantized
    r = read_report(out)
    lin_after = 0
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if k.rsplit(".", 1)[0] in summary["quantized"]:
                lin_after += f.get_tensor(k).numel() * f.get_tensor(k).element_size()
    fp = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    lin_before = sum(fp.get_submodule(p).weight.numel() * 4 for p in summary["quantized"])
    assert r["bytes"] == {"linear_before": lin_before, "linear_after": lin_after,
                          "checkpoint_before": os.path.getsize(
                              os.path.join(DEFAULT_MODEL, "model.safetensors")),
                          "checkpoint_after": os.path.getsize(
                              os.path.join(out, "model.safetensors"))}
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ppl = r["perplexity"]
    assert ppl["text"] == "eval.txt" and ppl["sha256"] == hashlib.sha256(EVAL.encode()).hexdigest()
    assert ppl["before"] == perplexity(nybble_logits_fn(DEFAULT_MODEL), tok, EVAL)["perplexity"]
    assert ppl["after"] == perplexity(nybble_logits_fn(out), tok, EVAL)["perplexity"]
    assert ppl["after"] != ppl["before"]


def test_readme_and_summary(quantized: tuple[str, dict], tmp_path,
                            caplog: pytest.LogCaptureFixture) -> None:
    out, _ = quantized
    r = read_report(out)
    readme = open(os.path.join(out, "README.md")).read()
    assert readme.startswith("# gptq 4-bit g32\n")
    assert f"{r['perplexity']['before']:.4f} | {r['perplexity']['after']:.4f}" in readme
    assert "| q_proj |" in readme and "Left dense: 15 linear layer(s)" in readme  # 3 MLP x 5 layers
    line = summarize_report(out)
    errs = {k: v["relative_output_error"] for k, v in r["layers"].items()}
    worst = max(errs, key=errs.get)
    assert line is not None and line.startswith("quantized by nybble ")
    assert "gptq 4-bit g32" in line and worst in line and f"{errs[worst] * 100:.1f}%" in line
    assert f"{r['perplexity']['before']:.4f} -> {r['perplexity']['after']:.4f}" in line
    assert summarize_report(DEFAULT_MODEL) is None  # no report: nothing to log
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / REPORT_FILE).write_text('{"schema_version": 99}')
    with caplog.at_level(logging.WARNING, logger="nybble.quant.report"):
        assert summarize_report(str(bad)) is None
    assert "schema_version 1, got 99" in caplog.text


def test_generate_logs_the_report_line_at_start_up(quantized: tuple[str, dict],
                                                   caplog: pytest.LogCaptureFixture,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``nybble generate`` (and ``nybble serve``, whose core process runs the same
    ``EngineCore`` start-up) logs the report's one line once; a folder without a report logs
    none."""
    from nybble.cli import main

    out, _ = quantized
    with caplog.at_level(logging.INFO, logger="nybble.runtime.engine.engine_core"):
        assert main(["generate", "--model", out, "Once", "--max-tokens", "2"]) == 0
    lines = [r.getMessage() for r in caplog.records if "quantization report" in r.getMessage()]
    assert lines == [f"quantization report: {summarize_report(out)}"]
    assert "held-out perplexity" in lines[0] and "gptq 4-bit g32" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nybble.runtime.engine.engine_core"):
        assert main(["generate", "Once", "--max-tokens", "2"]) == 0
    assert "quantization report" not in caplog.text
