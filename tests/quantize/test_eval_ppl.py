"""``nybble eval-ppl``: nybble's model scored against transformers' own log-likelihoods."""
from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nybble.cli import main
from nybble.config import DEFAULT_MODEL
from nybble.quantize.eval_ppl import hf_logits_fn, nybble_logits_fn, sequence_nll

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside.\n\n"
        "Tom and Sue went to the park. They saw a big dog. The dog was happy and ran to them.")


def _hf_nll(ids: list[int]) -> float:
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1].double(), -1)
    return float(-logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())


def test_full_window_nll_equals_transformers() -> None:
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(TEXT.split("\n\n")[0]).input_ids
    nll, n = sequence_nll(nybble_logits_fn(DEFAULT_MODEL), ids, window=512, stride=256)
    assert n == len(ids) - 1
    assert math.isclose(nll, _hf_nll(ids), rel_tol=1e-5)


def test_sliding_window_scores_every_token_once() -> None:
    ids = AutoTokenizer.from_pretrained(DEFAULT_MODEL)(TEXT.replace("\n\n", " ")).input_ids
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ours = nybble_logits_fn(DEFAULT_MODEL)
    nll_small, n_small = sequence_nll(ours, ids, window=16, stride=8)
    assert n_small == len(ids) - 1
    # Same windows through transformers give the same sum, and the windows really cut context.
    nll_ref, _ = sequence_nll(hf_logits_fn(model), ids, window=16, stride=8)
    assert math.isclose(nll_small, nll_ref, rel_tol=1e-5)
    assert not math.isclose(nll_small, _hf_nll(ids), rel_tol=1e-3)


def test_eval_ppl_cli(tmp_path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert main(["eval-ppl", DEFAULT_MODEL, "--text", str(text)]) == 0
    res = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    paras = TEXT.split("\n\n")
    total = sum(_hf_nll(tok(p).input_ids) for p in paras)
    count = sum(len(tok(p).input_ids) - 1 for p in paras)
    assert res["tokens"] == count
    assert math.isclose(res["perplexity"], math.exp(total / count), rel_tol=1e-5)


def test_eval_ppl_reads_a_gguf_file_like_its_folder(capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's F32 GGUF of stories3m holds the folder's float values: the same perplexity
    (the tokenizer comes from the GGUF's metadata)."""
    from tests.conftest import shared_path

    text = shared_path("data", "stories-heldout.txt")
    res = []
    for model in (shared_path("fixtures", "gguf", "stories3m-F32.gguf"),
                  shared_path("models", "stories3m")):
        assert main(["eval-ppl", model, "--text", text, "--max-paragraphs", "3"]) == 0
        res.append(json.loads(capsys.readouterr().out))
    assert res[0]["tokens"] == res[1]["tokens"] > 500
    assert abs(res[0]["perplexity"] / res[1]["perplexity"] - 1) < 1e-5
