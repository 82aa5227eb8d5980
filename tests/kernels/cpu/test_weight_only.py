"""The CPU weight-only path (nybble.kernels.cpu.weight_only) against the reference
dequantization: within the documented elementwise bound for every layout the loaders read,
and a wrong zero point or a dropped act-order permutation breaks that bound."""
from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from nybble.kernels.cpu import weight_only as cw
from nybble.kernels.reference.quant import IntWeight, dequantize_int_weight
from nybble.quant.compressed import Int8W8A8Linear
from nybble.quant.linear import QuantLinear
from nybble.quantize.hf_model import load_model
from tests.conftest import SHARED, shared_folders, shared_path

BASE = os.path.join(SHARED, "fixtures", "quant")
FIXTURES = [d for d in shared_folders("fixtures/quant/tiny-llama-*")
            if not isinstance(d, str) or os.path.basename(d) not in ("tiny-llama-fp32",
                                                                      "tiny-llama-ct-w8a8")]


def _random_weight(bits: int, k: int, n: int, gs: int, act_order: bool, sym: bool,
                   seed: int, mins: bool = False) -> tuple[IntWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (k, n), dtype=torch.int32, generator=g)
    groups = -(-k // gs)  # GPTQ allows a shorter last group
    if sym:
        z = torch.full((groups, n), 1 << (bits - 1), dtype=torch.int32)
    else:
        z = torch.randint(0, 1 << bits, (groups, n), dtype=torch.int32, generator=g)
    s = (torch.rand(groups, n, generator=g) * 0.01 + 1e-3).half()
    gi = torch.randperm(k, generator=g) // gs if act_order else None
    if mins:   # GGUF Q4_1/Q4_K: W = s q + m, float32 scales and minimums
        m = -(torch.rand(groups, n, generator=g) * 0.05)
        return IntWeight(q, z, gi, gs, bits, m), s.float()
    return IntWeight(q, z, gi, gs, bits), s


def _check(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor, y: torch.Tensor) -> float:
    """Largest ratio of |y - reference| to the documented bound (<= 1 passes)."""
    ref = x.double() @ dequantize_int_weight(iw, scales).double().t()
    return float(((y.double() - ref).abs() / cw.error_bound(x, iw, scales, ref)).max())


def _check_exact(x: torch.Tensor, iw: IntWeight, scales: torch.Tensor, y: torch.Tensor) -> float:
    """Largest ratio of |y - x @ (s (q - z))^T| (float64 oracle, no rounding of W) to the
    kernel's own float32 bound (<= 1 passes)."""
    k = iw.q.shape[0]
    g = torch.arange(k) // iw.group_size if iw.g_idx is None else iw.g_idx
    if iw.mins is None:
        w = scales.double()[g] * (iw.q.double() - iw.zero.double()[g])  # [K, N]
    else:
        w = scales.double()[g] * iw.q.double() + iw.mins.double()[g]
    ref = x.double() @ w
    bound = cw.error_bound(x, iw, scales, reference_rounding=False)
    return float(((y.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs,k,n", [(32, 128, 48), (128, 256, 64), (256, 512, 32),
                                    (512, 512, 16), (48, 96, 24), (32, 100, 72)])
@pytest.mark.parametrize("act_order,sym,mins", [(False, False, False), (True, False, False),
                                                (False, True, False), (False, False, True)])
def test_kernel_within_bound(bits: int, gs: int, k: int, n: int, act_order: bool,
                             sym: bool, mins: bool) -> None:
    """Group sizes that do and do not divide K, N not a multiple of the 32-column block,
    every row count the kernel's two ways take (1; 2-16 in threes and a remainder; more
    than 16 in chunks of 16 with a one-row or longer last chunk), GGUF's float minimums, the
    AVX2 and the portable loop."""
    iw, s = _random_weight(bits, k, n, gs, act_order, sym, seed=bits * 1000 + gs + k,
                           mins=mins)
    w, why = cw.prepare(iw, s)
    assert w is not None, why
    assert (w.perm is not None) == (act_order and k > gs)  # one group: nothing to reorder
    assert (w.mins is not None) == mins
    for rows in (1, 2, 4, 5, cw.MAX_ROWS, cw.MAX_ROWS + 1, 3 * cw.MAX_ROWS + 7):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        for portable in (False, True):
            y = cw.linear(x, w, None, portable=portable)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert 0 < _check_exact(x, iw, s, y) <= 1
            assert _check(x, iw, s, y) <= 1


def test_bias_and_dtype() -> None:
    iw, s = _random_weight(4, 128, 32, 64, False, False, seed=1)
    w, _ = cw.prepare(iw, s)
    assert w is not None
    x = torch.randn(2, 128)
    b = torch.randn(32)
    assert torch.allclose(cw.linear(x, w, b), cw.linear(x, w, None) + b, atol=1e-6)
    assert cw.linear(x.bfloat16(), w, None).dtype == torch.bfloat16


def test_strided_rows_read_in_place() -> None:
    """A row slice of a wider activation (stride != K) gives the contiguous result."""
    iw, s = _random_weight(8, 128, 64, 32, False, False, seed=2)
    w, _ = cw.prepare(iw, s)
    assert w is not None
    wide = torch.randn(3, 256)
    assert torch.equal(cw.linear(wide[:, :128], w, None),
                       cw.linear(wide[:, :128].contiguous(), w, None))


@pytest.mark.parametrize("bits", [4, 8])
def test_bound_catches_wrong_zero_point_and_lost_permutation(bits: int) -> None:
    iw, s = _random_weight(bits, 256, 64, 128, True, False, seed=3)
    z = iw.zero.clone()
    z[0] = (z[0] + 1) % (1 << bits)
    off_by_one = IntWeight(iw.q, z, iw.g_idx, iw.group_size, bits)
    w_bad, _ = cw.prepare(off_by_one, s)
    w, _ = cw.prepare(iw, s)
    assert w is not None and w.perm is not None and w_bad is not None
    for rows in (1, 4):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        assert _check_exact(x, iw, s, cw.linear(x, w, None)) <= 1
        assert _check_exact(x, iw, s, cw.linear(x, w_bad, None)) > 1
        no_perm = dataclasses.replace(w, perm=None)
        assert _check_exact(x, iw, s, cw.linear(x, no_perm, None)) > 1


def test_unsupported_layouts_give_a_reason() -> None:
    iw, s = _random_weight(4, 128, 16, 32, False, False, seed=5)
    two_bit = IntWeight(iw.q % 4, iw.zero % 4, None, 32, 2)
    assert cw.prepare(two_bit, s) == (None, "bits must be 4 or 8 for the CPU kernel, got 2")
    gi = torch.zeros(128, dtype=torch.int64)
    gi[64:] = 3  # groups of 64 and 64 rows, labelled as if group_size were 32
    bad = IntWeight(iw.q, iw.zero, gi, 32, 4)
    assert cw.prepare(bad, s)[1] == "g_idx groups are not all 32 rows wide"


def test_bad_calls_raise_value_errors() -> None:
    iw, s = _random_weight(4, 128, 32, 64, False, False, seed=6)
    w, _ = cw.prepare(iw, s)
    assert w is not None
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        cw.linear(torch.randn(2, 64), w, None)
    with pytest.raises(ValueError, match="x must have at least one row, got 0"):
        cw.cpu_wo_gemm.wo_gemm(torch.randn(0, 128).numpy(), w, torch.empty(0, 32).numpy())
    with pytest.raises(ValueError, match="packed must be a C-contiguous uint8 array"):
        cw.cpu_wo_gemm.wo_gemm(torch.randn(1, 128).numpy(),
                               dataclasses.replace(w, packed=w.packed[:-1]),
                               torch.empty(1, 32).numpy())


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
        long = torch.randn(cw.KERNEL_ROWS + 1, m.in_features, generator=g)  # reference path
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
