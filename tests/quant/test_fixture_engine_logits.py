"""Acceptance test of the engine's own model on every tool-written checkpoint: nybble's loader
and paged forward (what ``nybble serve`` runs) reproduce each tool's logits (atol 2e-3)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from tests.conftest import shared_path

BASE = shared_path("fixtures", "quant")
DIRS = sorted(d for d in os.listdir(BASE) if d.startswith("tiny-llama-"))


@pytest.mark.parametrize("d", DIRS)
def test_engine_logits_match_tool(d: str) -> None:
    path = os.path.join(BASE, d)
    ref = load_file(os.path.join(path, "reference_outputs.safetensors"))
    loaded = load_model(ModelConfig(model=path, dtype="float32", device="cpu"),
                        TorchAttentionBackend(), torch.device("cpu"))
    assert (loaded.quant_description == "none") == (d == "tiny-llama-fp32")
    logits = prefill_logits(loaded, [ref["input_ids"][0].tolist()])[0]
    expected = ref["logits"][0]
    if d == "tiny-llama-ct-w8a8":
        # The tool fake-quantizes activations along another fp16 rounding path: its own
        # weight-only logits are 8.3e-3 from these, ours 1.1e-2 (see test_fixtures.py).
        assert (logits - expected).abs().max() < 1.5e-2
        assert (logits - ref["logits_weight_only"][0]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(logits, expected, atol=2e-3, rtol=0)
