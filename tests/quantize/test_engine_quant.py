"""Quantized folders through the engine (``nybble.LLM``): greedy tokens equal those of a
transformers Llama carrying our quantized modules (nybble.quantize.hf_model, the oracle)."""
from __future__ import annotations

import os

import pytest
import torch

from nybble.config import DEFAULT_MODEL
from nybble.quantize.driver import QuantizeOptions, quantize_model
from nybble.quantize.hf_model import load_model
from tests.conftest import shared_path


def _oracle_greedy(model_dir: str, prompt: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(prompt)["input_ids"]
    m = load_model(model_dir)
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, m(input_ids=x).logits[0, -1].argmax().view(1, 1)], dim=1)
    return x[0, len(ids):].tolist()


def _engine_greedy(model_dir: str, prompt: str, n: int) -> list[int]:
    from nybble import LLM, SamplingParams

    out = LLM(model=model_dir).generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                                 ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_llm_generates_from_our_quantized_folder(tmp_path: str, method: str) -> None:
    out = os.path.join(tmp_path, method)
    opts = QuantizeOptions(method=method, bits=4, group_size=32, num_samples=8, seq_len=64,
                           allow_unquantized=True)   # stories260k's 172-wide MLP stays dense
    quantize_model(DEFAULT_MODEL, out, opts, progress=False)
    assert _engine_greedy(out, "Once upon a time", 12) == _oracle_greedy(out, "Once upon a time", 12)


@pytest.mark.parametrize("d", ["tiny-llama-gptq-4bit-g32-actorder", "tiny-llama-awq-4bit-g32",
                               "tiny-llama-ct-w4a16-g32"])
def test_llm_on_tool_checkpoints(d: str) -> None:
    path = shared_path("fixtures", "quant", d)
    assert _engine_greedy(path, "The keeper", 8) == _oracle_greedy(path, "The keeper", 8)
