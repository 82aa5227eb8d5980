"""Data-free calibration: text sampled from the model (nybble.quantize.sampled_calibration).

The oracle is transformers' own model: sampled at temperature 1 with no truncation, a token's
negative log-likelihood has the model's predictive entropy as its expectation, so over a few
thousand tokens their means agree (here within 2%); sampling at temperature 0.8 falls 20%
below it, and greedy decoding further.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from nybble.config import DEFAULT_MODEL
from nybble.quantize.driver import QuantizeOptions, quantize_model
from nybble.quantize.hf_model import load_model
from nybble.quantize.sampled_calibration import calibration_need, sample_calibration_ids


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model(DEFAULT_MODEL, torch.float32)


def test_the_need_grows_with_the_widest_input() -> None:
    assert calibration_need("rtn", 4096) == 0
    assert calibration_need("gptq", 64) == 2048
    assert calibration_need("awq", 1536) == 6144
    assert calibration_need("gptq-e2e", 576) == 2304


def test_windows_are_the_model_s_own_text_at_temperature_one(model: torch.nn.Module) -> None:
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    ids = sample_calibration_ids(model, 2048, 128, max_sequences=128)
    assert torch.equal(torch.random.get_rng_state(), before)   # the caller's RNG is left alone
    assert ids.shape == (16, 128) and ids.dtype == torch.int64
    assert torch.equal(ids, sample_calibration_ids(model, 2048, 128, max_sequences=128))
    assert not torch.equal(ids, sample_calibration_ids(model, 2048, 128, 128, seed=1))
    assert int(ids[0, 0]) == model.config.bos_token_id          # documents start at BOS
    assert 0 <= int(ids.min()) and int(ids.max()) < model.config.vocab_size
    # each document starts at BOS: score them one by one with the reference model
    stream = ids.flatten().tolist()
    starts = [i for i, t in enumerate(stream) if t == model.config.bos_token_id] + [len(stream)]
    nll, entropy, count = 0.0, 0.0, 0
    with torch.no_grad():
        for a, b in zip(starts, starts[1:]):
            doc = torch.tensor([stream[a:b]])
            if doc.shape[1] < 2:
                continue
            logp = model(doc).logits[0, :-1].double().log_softmax(-1)
            nll -= float(logp.gather(1, doc[0, 1:, None]).sum())
            entropy -= float((logp.exp() * logp).sum())
            count += doc.shape[1] - 1
    assert count > 1500
    assert abs(nll / count - entropy / count) < 0.05 * (entropy / count), (nll / count,
                                                                           entropy / count)


def test_max_sequences_caps_the_windows(model: torch.nn.Module) -> None:
    assert sample_calibration_ids(model, 4096, 64, max_sequences=3).shape == (3, 64)
    with pytest.raises(ValueError, match="seq_len >= 2"):
        sample_calibration_ids(model, 10, 1, 4)


def test_a_default_run_calibrates_on_enough_sampled_text(tmp_path: str) -> None:
    """No calib_text: the report says the text was sampled, with as many tokens as GPTQ
    needs (2048 for the bundled model's 64-wide inputs)."""
    out = os.path.join(tmp_path, "q")
    opts = QuantizeOptions(method="gptq", bits=8, group_size=32, sym=True,
                           allow_unquantized=True)
    quantize_model(DEFAULT_MODEL, out, opts, progress=False)
    cal = json.load(open(os.path.join(out, "quantization_report.json")))["calibration"]
    assert cal["source"].startswith("sampled from the model")
    assert cal["tokens_needed"] == 2048 and cal["tokens"] >= 2048 and cal["seq_len"] == 512
    assert "the method needs 2,048" in open(os.path.join(out, "README.md")).read()


def test_too_little_calibration_text_is_warned_about(tmp_path: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    opts = QuantizeOptions(method="gptq", bits=8, group_size=32, sym=True,
                           allow_unquantized=True, num_samples=4, seq_len=32,
                           calib_text="Once upon a time there was a cat.\n\nThe dog ran.")
    with caplog.at_level(logging.WARNING, logger="nybble.quantize.driver"):
        quantize_model(DEFAULT_MODEL, os.path.join(tmp_path, "q"), opts, progress=False)
    (msg,) = [r.getMessage() for r in caplog.records if "fewer than" in r.getMessage()]
    assert "fewer than the 2048 that gptq needs" in msg and "--calib" in msg
