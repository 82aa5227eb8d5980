"""nybble.runtime.worker.weight_pages: a quantized CPU model's packed weights and large float32
tensors move into one huge-page mapping with their values, ties and the engine's greedy output
unchanged; ``NYBBLE_CPU_HUGE_PAGES=0`` leaves them where they are."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nybble.config import ModelConfig
from nybble.kernels.cpu.backend import CpuAttentionBackend
from nybble.models.loader import load_model
from nybble.runtime.worker.weight_pages import (MIN_TENSOR_BYTES, huge_pages_enabled,
                                                place_weights_on_huge_pages)
from tests.conftest import shared_path


def _model(name: str = "stories3m-Q4_0.gguf"):
    cfg = ModelConfig(model=os.path.join(shared_path("fixtures", "gguf"), name),
                      dtype="float32", max_model_len=64, device="cpu",
                      cpu_activation_dtype="int16")
    return load_model(cfg, CpuAttentionBackend(), torch.device("cpu")).model


def _streamed(model) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    packed = [a for m in model.modules() if getattr(m, "cpu_packed", None) is not None
              for a in (m.cpu_packed.packed, m.cpu_packed.scales) if a is not None]
    big = [t for t in model.parameters()
           if t.dtype == torch.float32 and t.numel() * 4 >= MIN_TENSOR_BYTES]
    return packed, big


def test_weights_move_with_their_values(monkeypatch) -> None:
    monkeypatch.setenv("NYBBLE_CPU_HUGE_PAGES", "1")
    model = _model()
    packed, big = _streamed(model)
    assert packed                                    # this file's embedding is quantized too
    before = [a.copy() for a in packed] + [t.detach().clone() for t in big]
    ptrs = {a.ctypes.data for a in packed} | {t.data_ptr() for t in big}
    moved, huge = place_weights_on_huge_pages(model)
    assert moved >= sum(a.nbytes for a in packed) + sum(t.numel() * 4 for t in big)
    assert 0 <= huge <= moved
    after_packed, after_big = _streamed(model)
    for old, new in zip(before, after_packed + after_big):
        new_np = new.detach().numpy() if isinstance(new, torch.Tensor) else new
        assert np.array_equal(np.asarray(old), new_np)
    new_ptrs = {a.ctypes.data for a in after_packed} | {t.data_ptr() for t in after_big}
    assert not ptrs & new_ptrs                       # every one of them is a new copy
    lo = min(new_ptrs)
    assert all(p - lo < moved + 2**21 for p in new_ptrs)   # ... in one mapping


def test_tied_embedding_stays_tied(monkeypatch) -> None:
    monkeypatch.setenv("NYBBLE_CPU_HUGE_PAGES", "1")
    model = _model("stories3m-F32.gguf")
    emb = model.embed_tokens.weight
    assert model.lm_head is None and model._head_weight() is emb     # tied: one tensor
    before, ptr = emb.detach().clone(), emb.data_ptr()
    moved, _ = place_weights_on_huge_pages(model, min_tensor_bytes=1)  # its 512 x 256 too
    assert moved >= emb.numel() * 4
    assert model.embed_tokens.weight is emb and model._head_weight() is emb
    assert emb.data_ptr() != ptr and torch.equal(emb, before)


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("NYBBLE_CPU_HUGE_PAGES", "0")
    assert not huge_pages_enabled()
    model = _model()
    packed, _ = _streamed(model)
    ptrs = [a.ctypes.data for a in packed]
    assert place_weights_on_huge_pages(model) == (0, 0)
    assert [a.ctypes.data for a in _streamed(model)[0]] == ptrs


@pytest.mark.parametrize("name", ["stories3m-Q4_0.gguf"])
def test_engine_output_is_the_same_on_either_page_size(monkeypatch, name) -> None:
    from nybble import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = ["Once upon a time", "The dog ran to the"]
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("NYBBLE_CPU_HUGE_PAGES", flag)
        llm = LLM(os.path.join(shared_path("fixtures", "gguf"), name), max_num_seqs=4,
                  kv_cache_memory=8 * 2**20, cpu_activation_dtype="int16")
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[flag] = [(o.outputs[0].token_ids,
                       [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in res]
        llm.shutdown()
    assert outs["0"] == outs["1"]
