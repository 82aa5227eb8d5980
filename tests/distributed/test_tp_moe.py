"""Tensor parallelism of mixture-of-experts models: every expert split over 2 gloo ranks like
a dense MLP (router replicated, one all-reduce of the block's output) gives one rank's logits,
float and nybble-quantized (RTN 4-bit, groups of 16: each rank's half of an expert's 32-wide
intermediate dimension is one group)."""
from __future__ import annotations

import os

import pytest
import torch

from nybble.config import ModelConfig
from nybble.kernels import get_attention_backend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.quantize.driver import QuantizeOptions, quantize_model
from tests.distributed.tp_ranks import tp_prefill_logits
from tests.models.hf_moe import make_moe_model

SEQS = [[1, 45, 300, 22, 7, 99, 410, 3, 17, 250, 64, 12, 480, 33, 5, 271], [1, 500, 2, 8, 130]]


def _one_rank(model: str) -> list[torch.Tensor]:
    cpu = torch.device("cpu")
    return prefill_logits(load_model(ModelConfig(model=model, cpu_activation_dtype="float32"),
                                     get_attention_backend("torch", cpu), cpu), SEQS)


@pytest.mark.slow
@pytest.mark.parametrize("name,quantized", [("qwen3-moe", False), ("mixtral", False),
                                            ("qwen3-moe", True)])
def test_moe_logits_tp2_equal_tp1(tmp_path, name, quantized) -> None:
    model = make_moe_model(name, str(tmp_path))
    if quantized:
        out = os.path.join(tmp_path, "rtn")
        quantize_model(model, out, QuantizeOptions(method="rtn", bits=4, group_size=16),
                       progress=False)
        model = out
    ref = _one_rank(model)
    got = tp_prefill_logits(model, SEQS, 2, str(tmp_path))
    assert [g.shape for g in got] == [r.shape for r in ref]
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0)
