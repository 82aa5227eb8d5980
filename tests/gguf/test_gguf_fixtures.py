"""The ten llama.cpp-written stories3m GGUF files served as-is: logits equal transformers' on
the gguf-py-dequantized weights (transformers' own GGUF loading, float32) within float32
tolerance, 24 greedy tokens equal transformers', and the first prompt's tokens equal
``llama-server``'s (the fixture's cross-check: its 8-bit activations make later prompts drift
on some types)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from nybble import LLM
from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.sampling_params import SamplingParams
from tests.conftest import shared_path

BASE = shared_path("fixtures", "gguf")
FILES = sorted(f for f in os.listdir(BASE) if f.endswith(".gguf"))
with open(os.path.join(BASE, "llama_server_greedy.json"), encoding="utf-8") as fh:
    SERVER = json.load(fh)


@pytest.fixture(scope="module")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BASE, gguf_file=FILES[0])


def _hf_model(name: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BASE, gguf_file=name, dtype=torch.float32).eval()


# bf16-rounded activations (the CPU default): stories3m logits move by at most this (float32 path: 1e-4)
FAST_ATOL = 0.05  # measured: at most 0.027 over the 10 files x 3 prompts


def test_ten_fixtures() -> None:
    assert len(FILES) == 10


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_logits_and_greedy_tokens(name: str, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = os.path.join(BASE, name)
    hf = _hf_model(name)
    # the exact CPU path (float32 activations); the bf16 default is checked below
    loaded = load_model(ModelConfig(model=path, dtype="float32", device="cpu",
                                    cpu_activation_dtype="float32"),
                        TorchAttentionBackend(), torch.device("cpu"))
    fast = load_model(ModelConfig(model=path, dtype="float32", device="cpu",
                                  cpu_activation_dtype="bfloat16"),
                      TorchAttentionBackend(), torch.device("cpu"))
    prompts = [r["prompt"] for r in SERVER[name]]
    llm = LLM(path, dtype="float32", device="cpu", cpu_activation_dtype="float32")
    tok = llm.get_tokenizer()
    for i, prompt in enumerate(prompts):
        ids = hf_tokenizer(prompt)["input_ids"]
        assert tok.encode(prompt) == ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        got = prefill_logits(loaded, [ids])[0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
        fast_got = prefill_logits(fast, [ids])[0]
        torch.testing.assert_close(fast_got, expected, atol=FAST_ATOL, rtol=0)
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 min_new_tokens=24)[0, len(ids):].tolist()
        out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                    ignore_eos=True))[0].outputs[0]
        assert list(out.token_ids) == hf_out
        if i == 0:
            assert list(out.token_ids) == SERVER[name][0]["tokens"]
            assert out.text == SERVER[name][0]["content"]
