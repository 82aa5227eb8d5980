"""The engine on the Triton attention backend (the interpreter on CPU, native on CUDA) gives
transformers' greedy tokens for the windowed families: a prompt longer than the window,
soft-capping (Gemma 2), chunked prefill."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble import SamplingParams
from nybble.runtime.llm_engine import LLMEngine
from tests.models.hf_families import WINDOW, make_family_model
from tests.runtime.engine_helpers import run_requests

pytestmark = [pytest.mark.triton_interpret]


def _hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_triton_backend_greedy_matches_transformers(name: str, tmp_path) -> None:
    path = make_family_model(name, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine.from_engine_args(path, attention_backend="triton", dtype="float32",
                                        max_num_batched_tokens=16, block_size=8)
    prompts = {"long": list(range(50, 80)), "short": [1, 403, 407]}
    assert len(prompts["long"]) > 3 * WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    finals = run_requests(engine, [(k, ids, params) for k, ids in prompts.items()])
    for key, ids in prompts.items():
        assert finals[key].outputs[0].token_ids == _hf_greedy(hf, ids, 6), key
