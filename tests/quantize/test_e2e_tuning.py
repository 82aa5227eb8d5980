"""``gptq-e2e``: GPTQ's integers and zero points are kept, only the fp16 scales move, and the
quantized model's KL divergence from fp32 on the calibration sequences goes down; zero steps
change nothing; two runs write identical files."""
from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from nybble.config import DEFAULT_MODEL
from nybble.quantize.calibration import calibration_ids
from nybble.quantize.driver import QuantizeOptions, quantize_model
from nybble.quantize.e2e import TuneOptions, tune_scales
from nybble.quantize.hf_model import load_model

CALIB = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
         "the sun. One day she saw a big red ball in the park and ran to get it.\n\n"
         "Tom had a small dog. The dog liked to run and jump. They went to the lake.\n\n") * 6


def _opts(method: str, steps: int = 30) -> QuantizeOptions:
    return QuantizeOptions(method=method, bits=4, group_size=32, calib_text=CALIB,
                           allow_unquantized=True,
                           num_samples=6, seq_len=64, desc_act=True,
                           tune=TuneOptions(steps=steps, batch=3, lr=5e-3))


def _kl(folder: str, ids: torch.Tensor) -> float:
    fp, q = load_model(DEFAULT_MODEL), load_model(folder)
    with torch.no_grad():
        t = F.log_softmax(fp(ids).logits.double(), -1)
        s = F.log_softmax(q(ids).logits.double(), -1)
    return float((t.exp() * (t - s)).sum(-1).mean())


def test_scales_move_integers_stay_and_kl_drops(tmp_path) -> None:
    a = quantize_model(DEFAULT_MODEL, str(tmp_path / "gptq"), _opts("gptq"), progress=False)
    b = quantize_model(DEFAULT_MODEL, str(tmp_path / "e2e"), _opts("gptq-e2e"), progress=False)
    assert b["config"]["meta"]["method"] == "gptq-e2e" and b["config"]["quant_method"] == "gptq"
    assert QuantizeOptions(method="gptq-e2e").desc_act and not QuantizeOptions().desc_act
    moved = 0
    for name, ra in a["results"].items():
        rb = b["results"][name]
        assert torch.equal(ra.q, rb.q) and torch.equal(ra.zero, rb.zero)
        assert torch.equal(rb.scale, rb.scale.half().float()) and bool((rb.scale > 0).all())
        moved += int((ra.scale != rb.scale).sum())
    assert moved > 0
    tuning = b["report"]["tuning"]
    assert tuning["steps"] == 30 and tuning["kl_last"] < tuning["kl_first"]
    ids = calibration_ids(AutoTokenizer.from_pretrained(DEFAULT_MODEL), CALIB, 6, 64, 1)
    assert _kl(str(tmp_path / "e2e"), ids) < _kl(str(tmp_path / "gptq"), ids)


def test_zero_steps_is_identity() -> None:
    model = load_model(DEFAULT_MODEL)
    w = model.model.layers[0].self_attn.q_proj.weight.data.clone()
    from nybble.quantize.rtn import rtn_quantize

    res = rtn_quantize(w, 4, 32, sym=False)
    out, losses = tune_scales(load_model(DEFAULT_MODEL), model,
                              {"model.layers.0.self_attn.q_proj": res},
                              torch.ones(1, 8, dtype=torch.int64), TuneOptions(steps=0))
    r = out["model.layers.0.self_attn.q_proj"]
    assert losses == [] and torch.equal(r.scale, res.scale) and torch.equal(r.dequant, res.dequant)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight.data, res.dequant)
    assert all(p.requires_grad for p in model.parameters())  # restored


def test_deterministic(tmp_path) -> None:
    digests = []
    for name in ("a", "b"):
        quantize_model(DEFAULT_MODEL, str(tmp_path / name), _opts("gptq-e2e", steps=8),
                       progress=False)
        with open(os.path.join(tmp_path, name, "model.safetensors"), "rb") as f:
            digests.append(hashlib.sha256(f.read()).hexdigest())
    assert digests[0] == digests[1]
