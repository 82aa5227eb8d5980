"""The fused CPU step on quantized models (nybble.models.cpu_fused with packed projections):
against the same model's torch path, whose quantized layers call the same CPU kernels, the
final hidden states and KV-cache writes of a decode step and of a prefill chunk agree within
float32 summation-order tolerance, for GGUF files written by llama.cpp (Q4_0, Q4_1 with float
minimums, Q4_K_M with mixed-type fused projections, Q6_K, a quantized token embedding) and
GPTQ / AWQ checkpoints written by their tools (act order, 8-bit), on the exact path (float32
weight-only kernel) and, where the CPU has AVX-512 BF16, the bf16-dot one; greedy text through
the engine equals the op-by-op path's."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nybble.config import ModelConfig
from nybble.kernels.cpu.backend import CpuAttentionBackend
from nybble.kernels.cpu.qgemm import have_bf16
from nybble.kernels.cpu.weight_only import KERNEL_ROWS
from nybble.models.loader import load_model
from tests.conftest import shared_path

from .test_cpu_fused import (BLOCK, BLOCKS, _chunk_args, _decode_meta, _prefill, greedy_tokens,
                              steps_on_threads)

GGUF = ["stories3m-Q4_0.gguf", "stories3m-Q4_1.gguf", "stories3m-Q4_K_M.gguf",
        "stories3m-Q6_K.gguf"]
GPTQ = ["tiny-llama-gptq-4bit-g32-actorder", "tiny-llama-awq-4bit-g32",
        "tiny-llama-gptq-8bit-g32"]
PATHS = ["float32", "int16", "int8"] + (["bfloat16"] if have_bf16() else [])
"""The integer-dot kinds run everywhere (the portable C loop where the CPU lacks VNNI)."""


def _path(name: str) -> str:
    if name.endswith(".gguf"):
        return os.path.join(shared_path("fixtures", "gguf"), name)
    return os.path.join(shared_path("fixtures", "quant"), name)


def _setup(name: str, activations: str):
    cfg = ModelConfig(model=_path(name), dtype="float32", max_model_len=64, device="cpu",
                      cpu_activation_dtype=activations)
    model = load_model(cfg, CpuAttentionBackend(), torch.device("cpu")).model
    attn = model.layers[0].self_attn
    caches = [torch.zeros(2, BLOCKS, BLOCK, attn.num_kv_heads, attn.head_dim)
              for _ in model.layers]
    return model, caches


ROUNDING_ATOL = {"int16": 1e-3, "int8": 6e-2, "bfloat16": 1e-2}
"""Rounded activations (per block to 15 or 8 bits, or each to bfloat16): the paths' different
summation order of norms, RoPE and attention (~1e-6) can flip one activation's rounding,
which moves its products by a quantum (max|x| / 16383 or / 127 of its block, or 2^-9 of the
value). Measured on these files: int16 paths differ by at most 2.5e-4 (hidden values up to
5), less than either differs from the exact path (3.6e-4); int8 paths by up to 3.0e-2;
bf16 paths by up to 7.1e-3 (the Q6_K file's 8-bit weights, the portable step against the
fast one), less than either differs from the exact path (1.5e-2). The kernels themselves
are checked bit for bit, portable loop against AVX-512, in tests/kernels/cpu."""


def _close(got: torch.Tensor, want: torch.Tensor, caches, torch_caches,
           activations: str = "float32") -> None:
    # the same kernels on both paths; norms, RoPE and attention sum in another order
    # (measured: hidden states within 3e-6 of values up to 5, KV within 2e-6)
    atol = ROUNDING_ATOL.get(activations)
    torch.testing.assert_close(got, want, rtol=1e-5 if atol is None else 0, atol=atol or 2e-5)
    for c, tc in zip(caches, torch_caches):
        torch.testing.assert_close(c, tc, rtol=1e-5 if atol is None else 0, atol=atol or 1e-5)


@pytest.mark.parametrize("activations", PATHS)
@pytest.mark.parametrize("name", GGUF + GPTQ)
def test_quantized_step_equals_the_torch_path(name: str, activations: str) -> None:
    model, caches = _setup(name, activations)
    _prefill(model, caches)
    ids, pos, meta = _decode_meta()
    torch_caches = [c.clone() for c in caches]
    with torch.no_grad():
        want = model(ids, pos, torch_caches, meta)      # not enabled yet: the torch path
    why = model.enable_fused_cpu_decode(caches)
    kernel = {"float32": "weight-only", "bfloat16": "bf16-dot"}.get(activations, "integer-dot")
    assert why.startswith("fused C step") and kernel in why, why
    got = model(ids, pos, caches, meta)
    _close(got, want, caches, torch_caches, activations)
    out = np.empty((3, model.config.hidden_size), np.float32)   # the portable C loops
    model.fused_decode.decoder.forward(ids.numpy(), pos.numpy(), meta.slot_mapping.numpy(),
                                       meta.block_tables.numpy(), meta.seq_lens.numpy(), out,
                                       portable=True)
    atol = ROUNDING_ATOL.get(activations)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-5 if atol is None else 0,
                               atol=atol or 2e-5)


@pytest.mark.parametrize("name", ["stories3m-Q4_K_M.gguf", "tiny-llama-gptq-4bit-g32-actorder"])
def test_quantized_prefill_chunks_equal_the_torch_path(name: str) -> None:
    """Several tokens per sequence (prefill chunks; the quantized embedding's rows looked up
    in C) run fused up to the kernel's row limit, with the torch path's results."""
    model, caches = _setup(name, "float32")
    model.enable_fused_cpu_decode(caches)
    fused, torch_caches = model.fused_decode, [c.clone() for c in caches]
    assert fused.max_tokens == KERNEL_ROWS
    for lo, hi in ((0, 3), (3, None)):
        ids, pos, meta = _chunk_args(lo, hi)
        got = fused(ids, pos, caches, meta)
        assert got is not None
        with torch.no_grad():
            model.fused_decode = None
            want = model(ids, pos, torch_caches, meta)
            model.fused_decode = fused
        _close(got, want, caches, torch_caches)
    fused.max_tokens = 2     # more tokens than the cap: the torch path's (None)
    ids, pos, meta = _decode_meta()
    assert fused(ids, pos, caches, meta) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stories3m-Q4_1.gguf", "tiny-llama-gptq-4bit-g32-actorder"])
def test_engine_greedy_text_is_unchanged(name: str) -> None:
    """The runner turns the fused step on for a quantized model; greedy tokens equal the
    op-by-op path's (``enforce_eager``) on the exact path."""
    outs = {eager: greedy_tokens(eager, lambda llm: llm.llm_engine.loaded.model,
                                 model=_path(name), cpu_activation_dtype="float32")
            for eager in (False, True)}
    assert outs[False] == outs[True]


def test_mixed_kernels_in_one_projection_are_refused() -> None:
    """A fused projection whose parts sit on different kernels is left to the torch path,
    and the reason names the layer."""
    model, caches = _setup("stories3m-Q4_K_M.gguf", "float32")
    mixed = [(i, layer.self_attn.qkv_proj.parts) for i, layer in enumerate(model.layers)
             if len(layer.self_attn.qkv_proj.parts) > 1]
    assert mixed, "Q4_K_M puts some attn_v in Q6_K: a q/k/v of several parts"
    i, parts = mixed[0]
    assert all(p.cpu_weight is not None for p in parts)
    parts[0].cpu_weight = None    # as if this part's layout had no kernel
    why = model.enable_fused_cpu_decode(caches)
    assert model.fused_decode is None and why.startswith(f"layer {i} has projections"), why


@pytest.mark.parametrize("activations", ["int16", "float32"])
@pytest.mark.parametrize("name", ["stories3m-Q4_K_M.gguf", "tiny-llama-gptq-4bit-g32-actorder"])
def test_threads_write_what_one_thread_writes(name: str, activations: str) -> None:
    """The step on two and three threads (pool.h: projections' column blocks and the
    sequences' attention split) equals the one-thread step bit for bit, hidden states and KV."""
    model, caches = _setup(name, activations)
    _prefill(model, caches)
    ids, pos, meta = _decode_meta()
    model.enable_fused_cpu_decode(caches)
    results = steps_on_threads(model, caches, ids, pos, meta, (1, 2, 3))
    for got, kv in results[1:]:
        assert torch.equal(got, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kv, results[0][1]))
