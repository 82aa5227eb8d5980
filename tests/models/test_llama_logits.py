"""Our model's prefill logits equal transformers' (float32, 1e-4) for every architecture."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble.config import DEFAULT_MODEL, ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits

from .hf_tiny import VARIANTS, make_tiny_model


def _prefill_logits(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    loaded = load_model(ModelConfig(model=model_dir), TorchAttentionBackend(),
                        torch.device("cpu"))
    return prefill_logits(loaded, prompts)


def _hf_logits(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 40)), [1] + list(range(100, 117)), [7]]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_transformers(variant: str, tmp_path) -> None:
    path = make_tiny_model(variant, str(tmp_path))
    ours = _prefill_logits(path, PROMPTS)
    ref = _hf_logits(path, PROMPTS)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_bundled_model_logits_match_transformers() -> None:
    ours = _prefill_logits(DEFAULT_MODEL, PROMPTS)
    ref = _hf_logits(DEFAULT_MODEL, PROMPTS)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
