"""The bfloat16 prefill GEMM of quantized models on the CPU (``--cpu-prefill-gemm``,
``CpuPathLog.prefill_rows``): how the choice resolves, that a long prefill step leaves the
fused C step for the torch path whose packed layers call ``qgemm_pack.prefill_linear``, and
that its hidden states and KV writes stay within bfloat16 rounding of the decode kernels'
(the same step with ``kernel``), on a llama.cpp Q4_0 file and a GPTQ act-order checkpoint."""
from __future__ import annotations

import pytest
import torch

from nybble.config import ModelConfig
from nybble.engine_args import add_engine_args, engine_config_from_args
from nybble.kernels.cpu import qgemm_pack
from nybble.kernels.cpu.backend import CpuAttentionBackend
from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.cpu import qgemm as cpu_qgemm
from nybble.models.loader import cpu_prefill_gemm, cpu_prefill_rows, load_model

from .test_cpu_fused_quant import _path

TOKENS = qgemm_pack.PREFILL_ROWS + 22
BLOCK, BLOCKS = 16, 16


def test_the_choice_resolves_by_cpu_and_activations() -> None:
    rows = qgemm_pack.PREFILL_ROWS
    amx, avx2 = qgemm_pack.has_amx_bf16(), cpu_qgemm.idot_fast_path() == "AVX2"
    bf16_rows = rows if amx else qgemm_pack.PREFILL_ROWS_AVX512_BF16
    assert cpu_prefill_rows("kernel", "int16") is None
    assert cpu_prefill_rows("bfloat16", "int16") == bf16_rows
    assert cpu_prefill_rows("float32", "int16") == rows
    assert cpu_prefill_gemm("float32", "int16") == "float32"
    assert cpu_prefill_rows("auto", "float32") is None        # the exact path stays exact
    bf16 = amx or cpu_qgemm.have_bf16()
    auto = "bfloat16" if bf16 else "float32" if avx2 else None
    assert cpu_prefill_gemm("auto", "int16") == auto
    assert cpu_prefill_gemm("auto", "int8") == auto
    assert cpu_prefill_gemm("auto", "bfloat16") == ("bfloat16" if amx else None)
    assert cpu_prefill_rows("auto", "int16") == (None if auto is None else
                                                 bf16_rows if auto == "bfloat16" else rows)
    with pytest.raises(ValueError, match="cpu_prefill_gemm"):
        ModelConfig(cpu_prefill_gemm="amx")
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--cpu-prefill-gemm", "kernel"]))
    assert cfg.model_config.cpu_prefill_gemm == "kernel"


def _model(name: str, choice: str):
    cfg = ModelConfig(model=_path(name), dtype="float32", max_model_len=256, device="cpu",
                      cpu_activation_dtype="int16", cpu_prefill_gemm=choice)
    model = load_model(cfg, CpuAttentionBackend(), torch.device("cpu")).model
    attn = model.layers[0].self_attn
    caches = [torch.zeros(2, BLOCKS, BLOCK, attn.num_kv_heads, attn.head_dim)
              for _ in model.layers]
    return model, caches


def _prompt_meta(vocab: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (TOKENS,), generator=g)
    nb = -(-TOKENS // BLOCK)
    assert nb <= BLOCKS
    table = torch.arange(nb, dtype=torch.int32)[None, :]
    meta = AttentionMetadata(slot_mapping=torch.arange(TOKENS), block_tables=table,
                             seq_lens=torch.tensor([TOKENS], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, TOKENS], dtype=torch.int32),
                             max_seq_len=TOKENS, max_query_len=TOKENS, is_decode_only=False)
    return ids, torch.arange(TOKENS), meta


@pytest.mark.parametrize("name", ["stories3m-Q4_0.gguf", "tiny-llama-gptq-4bit-g32-actorder"])
def test_long_prefill_takes_the_float32_gemm_exactly(name, monkeypatch) -> None:
    """``--cpu-prefill-gemm float32``: a long step leaves the fused C step and its packed layers
    multiply by the float32 dequantized weight; the result is the exact path's (float32
    activations through the weight-only kernel / reference) within float32 summation order,
    far closer than the int16 kernel's activation rounding."""
    real = qgemm_pack.prefill_linear
    calls = []
    monkeypatch.setattr(qgemm_pack, "prefill_linear",
                        lambda *a: calls.append((a[0].shape[0], a[3])) or real(*a))
    model, caches = _model(name, "float32")
    why = model.enable_fused_cpu_decode(caches)
    assert "float32 prefill GEMM" in why, why
    ids, pos, meta = _prompt_meta(model.config.vocab_size)
    assert model.fused_decode(ids, pos, caches, meta) is None    # deferred to the torch path
    with torch.no_grad():
        hidden = model(ids, pos, caches, meta)
    assert calls and all(c == (TOKENS, "float32") for c in calls)
    cfg = ModelConfig(model=_path(name), dtype="float32", max_model_len=256, device="cpu",
                      cpu_activation_dtype="float32")
    exact = load_model(cfg, CpuAttentionBackend(), torch.device("cpu")).model
    ex_caches = [torch.zeros_like(c) for c in caches]
    with torch.no_grad():
        h_exact = exact(ids, pos, ex_caches, meta)
    scale = float(h_exact.abs().max())
    assert float((hidden - h_exact).abs().max()) < 1e-4 * scale
    for a, b in zip(caches, ex_caches):
        assert float((a - b).abs().max()) < 1e-4 * float(b.abs().max()) + 1e-6


@pytest.mark.parametrize("name", ["stories3m-Q4_0.gguf", "tiny-llama-gptq-4bit-g32-actorder"])
def test_long_prefill_takes_the_bf16_gemm_within_its_rounding(name, monkeypatch) -> None:
    # the route's numerics at PREFILL_ROWS + 22 rows, also where the CPU (no AMX) would take
    # it only from PREFILL_ROWS_AVX512_BF16 rows (more than this checkpoint's 256 positions)
    from nybble.models import loader
    monkeypatch.setattr(loader, "PREFILL_ROWS_AVX512_BF16", qgemm_pack.PREFILL_ROWS)
    results = {}
    real = qgemm_pack.prefill_linear
    for choice in ("kernel", "bfloat16"):
        model, caches = _model(name, choice)
        why = model.enable_fused_cpu_decode(caches)
        assert why.startswith("fused C step")
        assert ("bfloat16 prefill GEMM" in why) == (choice == "bfloat16"), why
        ids, pos, meta = _prompt_meta(model.config.vocab_size)
        calls = []
        monkeypatch.setattr(qgemm_pack, "prefill_linear",
                            lambda *a: calls.append(a[0].shape[0]) or real(*a))
        if choice == "bfloat16":
            assert model.fused_decode(ids, pos, caches, meta) is None    # deferred
        with torch.no_grad():
            hidden = model(ids, pos, caches, meta)
        assert (len(calls) > 0) == (choice == "bfloat16")
        assert all(rows == TOKENS for rows in calls)
        results[choice] = hidden, [c.clone() for c in caches]
    (h_k, c_k), (h_b, c_b) = results["kernel"], results["bfloat16"]
    # bfloat16 weights, activations and outputs (relative 2^-9 each) through the layers:
    # measured here up to ~4% of the largest hidden value; the KV writes likewise
    scale = float(h_k.abs().max())
    assert float((h_b - h_k).abs().max()) < 0.08 * scale
    assert float((h_b - h_k).abs().mean()) < 0.01 * float(h_k.abs().mean()) * 3
    assert not torch.equal(h_b, h_k)         # the other GEMM really ran
    for a, b in zip(c_b, c_k):
        assert float((a - b).abs().max()) < 0.08 * float(b.abs().max()) + 1e-6


def test_auto_activations_follow_the_cpu() -> None:
    """``--cpu-activation-dtype auto``: int16 with VNNI, bfloat16 with AVX-512 BF16, else the
    exact float32 (also on AVX2, where int16 is opt-in); other choices are taken as given."""
    from nybble.models.loader import cpu_activations

    vnni = cpu_qgemm.have_vnni()
    assert cpu_activations("auto") == ("int16" if vnni else "bfloat16" if cpu_qgemm.have_bf16()
                                       else "float32")
    for choice in ("int16", "int8", "float32", "bfloat16"):
        assert cpu_activations(choice) == choice
