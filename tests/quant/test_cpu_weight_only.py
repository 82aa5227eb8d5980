"""The CPU weight-only path (nybble.kernels.cpu_weight_only) against the reference
dequantization: within the documented elementwise bound for every layout the loaders read,
and a wrong zero point or a dropped act-order permutation breaks that bound."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from nybble.kernels import cpu_weight_only as cw
from nybble.kernels.reference_quant import IntWeight, dequantize_int_weight
from nybble.quant.compressed import Int8W8A8Linear
from nybble.quant.linear import QuantLinear
from nybble.quantize.hf_model import load_model
from tests.conftest import SHARED, shared_folders, shared_path

BASE = os.path.join(SHARED, "fixtures", "quant")
FIXTURES = [d for d in shared_folders("fixtures/quant/tiny-llama-*")
            if not isinstance(d, str) or os.path.basename(d) not in ("tiny-llama-fp32",
                                                                      "tiny-llama-ct-w8a8")]


def _random_weight(bits: int, k: int, n: int, gs: int, act_order: bool, sym: bool,
                   seed: int) -> tuple[IntWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), dtype=torch.int32, generator=g)
    if sym:
        z = torch.full((k // gs, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        z = torch.randint(0, 1 << bits, (k // gs, n), dtype=torch.int32, generator=g)
    s = (torch.rand(k // gs, n, generator=g) * 0.01 + 1e-3).half()
    gi = torch.randperm(k, generator=g) // gs if act_order else None
    return IntWeight(q, z, gi, gs, bits), s


def _check(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor, y: torch.Tensor) -> float:
    """Largest ratio of |y - reference| to the documented bound (<= 1 passes)."""
    ref = x.double() @ dequantize_int_weight(iw, scales).double().t()
    return float(((y.double() - ref).abs() / cw.error_bound(x, iw, scales, ref)).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs,k,n", [(32, 128, 48), (128, 256, 64), (256, 512, 32),
                                    (512, 512, 16)])
@pytest.mark.parametrize("act_order,sym", [(False, False), (True, False), (False, True)])
def test_kernel_within_bound(bits: int, gs: int, k: int, n: int, act_order: bool,
                             sym: bool) -> None:
    iw, s = _random_weight(bits, k, n, gs, act_order, sym, seed=bits * 1000 + gs + k)
    w, why = cw.prepare(iw, s)
    assert w is not None, why
    assert (w.perm is not None) == (act_order and k > gs)  # one group: nothing to reorder
    for rows in (1, 5, cw.MAX_ROWS):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y = cw.linear(x, w, None)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert 0 < _check(x, iw, s, y) <= 1


def test_bias_and_dtype() -> None:
    iw, s = _random_weight(4, 128, 32, 64, False, False, seed=1)
    w, _ = cw.prepare(iw, s)
    assert w is not None
    x = torch.randn(2, 128)
    b = torch.randn(32)
    assert torch.allclose(cw.linear(x, w, b), cw.linear(x, w, None) + b, atol=1e-6)
    assert cw.linear(x.bfloat16(), w, None).dtype == torch.bfloat16


def test_bound_catches_wrong_zero_point_and_lost_permutation() -> None:
    iw, s = _random_weight(4, 256, 64, 128, True, False, seed=3)
    x = torch.randn(4, 256)
    z = iw.zero.clone()
    z[0] = (z[0] + 1) % 16
    off_by_one = IntWeight(iw.q, z, iw.g_idx, iw.group_size, 4)
    w_bad, _ = cw.prepare(off_by_one, s)
    assert w_bad is not None and _check(x, iw, s, cw.linear(x, w_bad, None)) > 1
    w, _ = cw.prepare(iw, s)
    assert w is not None and w.perm is not None
    no_perm = cw.CpuInt4Weight(w.packed, w.scales_and_zeros, w.group_size, None)
    assert _check(x, iw, s, cw.linear(x, no_perm, None)) > 1


def test_unsupported_layouts_give_a_reason() -> None:
    iw, s = _random_weight(4, 96, 32, 48, False, False, seed=4)  # group 48: no kernel group
    assert cw.prepare(iw, s) == (None, "group_size 48 is not a multiple of 32")
    iw, s = _random_weight(4, 128, 24, 32, False, False, seed=5)
    assert cw.prepare(iw, s) == (None, "out_features must be a multiple of 16, got 24")
    gi = torch.zeros(128, dtype=torch.int64)
    gi[64:] = 3  # groups of 64 and 64 rows, labelled as if group_size were 32
    bad = IntWeight(iw.q[:, :16].contiguous(), iw.zero[:, :16].contiguous(), gi, 32, 4)
    assert cw.prepare(bad, s[:, :16])[1] == "g_idx groups are not all 32 rows wide"


@pytest.mark.parametrize("d", FIXTURES)
def test_fixture_layers_take_the_kernels(d: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every weight-only checkpoint layout of the tools (GPTQ v1/v2, sym/asym, act order,
    per-channel, 8-bit; AWQ GEMM; compressed-tensors W4A16) runs on the kernels within the
    bound, and the choice is logged once per model."""
    with caplog.at_level(logging.INFO, logger="nybble.quant.linear"):
        model = load_model(d)
    mods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(mods) == 14
    notes = [r.getMessage() for r in caplog.records if "CPU matmul" in r.getMessage()]
    assert len(notes) == 1 and "kernel" in notes[0], notes
    g = torch.Generator().manual_seed(0)
    for m in mods:
        assert m.cpu_weight is not None
        x = torch.randn(3, m.in_features, generator=g)
        assert 0 < _check(x, m.int_weight(), m.weight_scales(), m(x)) <= 1
        long = torch.randn(cw.MAX_ROWS + 1, m.in_features, generator=g)  # reference path
        ref = long.double() @ m.dequantized_weight().double().t()
        torch.testing.assert_close(m(long).double(), ref, atol=1e-4, rtol=1e-4)


def test_w8a8_and_disabled_stay_on_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    shared_path("fixtures", "quant")
    with caplog.at_level(logging.INFO, logger="nybble.quant.linear"):
        model = load_model(os.path.join(BASE, "tiny-llama-ct-w8a8"))
        assert all(m.cpu_weight is None for m in model.modules() if isinstance(m, Int8W8A8Linear))
        monkeypatch.setenv("NYBBLE_CPU_WEIGHT_ONLY", "0")
        model = load_model(os.path.join(BASE, "tiny-llama-awq-4bit-g32"))
        assert all(m.cpu_weight is None for m in model.modules() if isinstance(m, QuantLinear))
    notes = [r.getMessage() for r in caplog.records if "CPU matmul" in r.getMessage()]
    assert notes == ["compressed-tensors W8A8: CPU matmul reference (activations are quantized "
                     "too; no weight-only kernel)",
                     "AWQ 4-bit: CPU matmul reference (NYBBLE_CPU_WEIGHT_ONLY=0)"]
