"""The engine gives the same greedy tokens with the Triton attention backend (the interpreter
on CPU, native on CUDA) as with the torch reference backend, on the bundled real model."""
from __future__ import annotations

import pytest

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL

pytestmark = [pytest.mark.triton_interpret, pytest.mark.slow]

PROMPTS = ["Once upon a time", "The dog", "Tom and Sue went to the park. They saw"]


def _greedy(backend: str) -> list[list[int]]:
    # A small budget forces chunked prefill, so mixed prefill + decode batches run too.
    llm = LLM(DEFAULT_MODEL, attention_backend=backend, max_num_batched_tokens=8,
              num_gpu_blocks=64, dtype="float32")
    assert llm.llm_engine.loaded.model.layers[0].self_attn.backend.name == backend
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_triton_backend_matches_torch_backend() -> None:
    assert _greedy("triton") == _greedy("torch")
