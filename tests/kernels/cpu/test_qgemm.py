"""The CPU's bf16-dot quantized GEMM (nybble/kernels/cpu/qgemm.h) against a float64 oracle
with the activation rounding modelled: y64 = bf16(x) @ W^T in float64 with the exact weight
W = s (q - z) or s q + m; |y - y64| within the documented float32-summation bound
(cpu_qgemm_pack.error_bound), on the AVX-512 BF16 path and the portable C loop, for 4/8 bits,
symmetric / integer-zero / float-minimum weights, act order, a short last group, column
counts that are not a multiple of 16 and row counts that hit every register tile."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.kernels.cpu import qgemm as cpu_qgemm
from nybble.kernels.cpu import qgemm_pack as cpu_qgemm_pack
from nybble.kernels.reference.quant import IntWeight


def _weight(bits: int, k: int, n: int, gs: int, mode: str, act_order: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (k, n), dtype=torch.int32, generator=g)
    groups = -(-k // gs)
    off = 2 ** (bits - 1)
    zero = (torch.full((groups, n), off, dtype=torch.int32) if mode != "zero" else
            torch.randint(0, 2 ** bits, (groups, n), dtype=torch.int32, generator=g))
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 1e-3).half()
    mins = (torch.randn(groups, n, generator=g) * 0.05).half().float() if mode == "min" else None
    g_idx = (torch.randperm(k, generator=g) // gs) if act_order else None
    return IntWeight(q, zero, g_idx, gs, bits), scales, mins


def _exact(iw: IntWeight, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """W [N, K] float64 from the format's rule."""
    g = torch.arange(iw.q.shape[0]) // iw.group_size if iw.g_idx is None else iw.g_idx
    s = scales.double()[g]
    if mins is None:
        return (s * (iw.q.double() - iw.zero.double()[g])).t()
    return (s * iw.q.double() + mins.double()[g]).t()


CASES = [(4, 64, 40, 32), (4, 576, 200, 32), (4, 256, 17, 128), (4, 96, 33, 64),
         (8, 64, 40, 32), (8, 576, 120, 32), (8, 100, 24, 20)]


@pytest.mark.parametrize("bits,k,n,gs", CASES)
@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 19, 70])
@pytest.mark.parametrize("portable", [False, True])
def test_qgemm_within_bound_of_float64_oracle(bits, k, n, gs, mode, rows, portable) -> None:
    if not portable and not cpu_qgemm.have_bf16():
        pytest.skip("this CPU has no AVX-512 BF16: only the portable loop runs")
    act_order = k == 96 and mode == "zero"
    iw, scales, mins = _weight(bits, k, n, gs, mode, act_order, seed=rows * 7 + bits)
    packed, why = cpu_qgemm_pack.pack(iw, scales, mins)
    assert packed is not None, why
    assert packed.mode == {"sym": cpu_qgemm_pack.SYM, "zero": cpu_qgemm_pack.ZERO,
                           "min": cpu_qgemm_pack.MIN}[mode]
    assert packed.scales.dtype == np.uint16  # float16 scales are kept as float16
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    y = cpu_qgemm_pack.linear(x, packed, bias, portable=portable).double()
    y64 = cpu_qgemm_pack.round_bf16(x).double() @ _exact(iw, scales, mins).t() + bias.double()
    bound = cpu_qgemm_pack.error_bound(x, iw, scales, mins) + 2.0 ** -23 * y64.abs()
    assert bool(((y - y64).abs() <= bound).all()), float(((y - y64).abs() / bound).max())
    # the activations really are rounded: unrounded x is further off than the bound allows
    y_unrounded = x.double() @ _exact(iw, scales, mins).t() + bias.double()
    assert bool(((y - y_unrounded).abs() > bound).any())


def test_float32_scales_accumulate_and_strided_output() -> None:
    iw, scales, _ = _weight(4, 128, 48, 32, "zero", False, seed=3)
    s32 = scales.float() * (1 + 1e-6)              # not float16 values: kept as float32
    packed, _ = cpu_qgemm_pack.pack(iw, s32)
    assert packed.scales.dtype == np.float32
    x = torch.randn(4, 128)
    out = torch.randn(4, 64)
    before = out.clone()
    cpu_qgemm.qgemm(x.numpy(), packed, out.numpy()[:, 8:], None, True)
    y64 = cpu_qgemm_pack.round_bf16(x).double() @ _exact(iw, s32, None).t()
    got = out[:, 8:56].double() - before[:, 8:56].double()
    assert bool(((got - y64).abs() <= cpu_qgemm_pack.error_bound(x, iw, s32) + 1e-6).all())
    assert torch.equal(out[:, :8], before[:, :8]) and torch.equal(out[:, 56:], before[:, 56:])


def test_layout_and_shape_errors() -> None:
    iw, scales, _ = _weight(4, 60, 16, 20, "sym", False, seed=1)
    packed, why = cpu_qgemm_pack.pack(iw, scales)
    assert packed is None and "multiples of 8" in why
    iw, scales, _ = _weight(4, 64, 16, 32, "sym", False, seed=1)
    packed, _ = cpu_qgemm_pack.pack(iw, scales)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        cpu_qgemm_pack.linear(torch.randn(2, 32), packed, None)
    with pytest.raises(ValueError, match="out must be"):
        cpu_qgemm.qgemm(np.zeros((2, 64), np.float32), packed, np.zeros((3, 16), np.float32))


def test_packing_follows_the_documented_layout() -> None:
    """A few bytes checked against cpu_qgemm.h's layout comment directly."""
    q = torch.arange(8 * 32, dtype=torch.int32).reshape(8, 32) % 16   # K = 8, N = 32
    iw = IntWeight(q, torch.full((1, 32), 8, dtype=torch.int32), None, 8, 4)
    packed, _ = cpu_qgemm_pack.pack(iw, torch.ones(1, 32).half())
    words = packed.packed.view(np.uint16)
    for jb in range(2):
        for j in range(32):
            for t in range(4):
                assert (int(words[jb * 32 + j]) >> (4 * t)) & 15 == \
                    int(q[2 * t + j % 2, 16 * jb + j // 2])
    q8 = torch.randint(0, 256, (4, 16), dtype=torch.int32)
    iw8 = IntWeight(q8, torch.full((1, 16), 128, dtype=torch.int32), None, 4, 8)
    b = cpu_qgemm_pack.pack(iw8, torch.ones(1, 16).half())[0].packed.view(np.int8)
    for kp in range(2):
        for byte in range(32):
            col = byte // 2 if byte < 16 else 8 + (byte - 16) // 2
            assert int(b[kp * 32 + byte]) == int(q8[2 * kp + byte % 2, col]) - 128
