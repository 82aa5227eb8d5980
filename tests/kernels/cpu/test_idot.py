"""The CPU's integer-dot quantized GEMM (nybble/kernels/cpu/idot.h: AVX-512 VNNI, or AVX2's
VPMADDUBSW where the CPU has no VNNI) against a
float64 oracle with the activation quantization modelled: y64 = xq @ W^T in float64, xq the
per-block 8-bit / 15-bit activations as the format rule in the header defines them
(cpu_qgemm_pack.quantize_activations), W the exact weight; |y - y64| within the documented
float32 bound (cpu_qgemm_pack.idot_error_bound); the SIMD path this CPU runs equal to the
portable C loop bit for bit, also where AVX2's int16 lanes reach their documented extreme; the
packed bytes as the layout comment says."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.kernels.cpu import qgemm as cpu_qgemm
from nybble.kernels.cpu import qgemm_pack as cpu_qgemm_pack
from nybble.kernels.reference.quant import IntWeight
from tests.kernels.cpu.test_qgemm import _exact, _weight

CASES = [(4, 64, 40, 32), (4, 576, 200, 32), (4, 256, 17, 128), (4, 96, 33, 64),
         (4, 48, 20, 24), (8, 64, 40, 32), (8, 576, 120, 32), (8, 100, 24, 20),
         (8, 64, 16, 16)]
KINDS = {"int8": 1, "int16": 2}


def _vnni() -> bool:
    """True when this CPU runs a SIMD loop of the integer-dot kernel (VNNI or AVX2)."""
    return cpu_qgemm.idot_fast_path() is not None


@pytest.mark.parametrize("bits,k,n,gs", CASES)
@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 19, 70])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_idot_within_bound_of_float64_oracle(bits, k, n, gs, mode, rows, kind) -> None:
    act_order = k == 96 and mode == "zero"
    iw, scales, mins = _weight(bits, k, n, gs, mode, act_order, seed=rows * 5 + bits)
    packed, why = cpu_qgemm_pack.pack(iw, scales, mins, activations=kind)
    assert packed is not None, why
    assert packed.planes == KINDS[kind] and "integer-dot" in why
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + 1))
    x[0, :8] *= 50.0                        # an outlier block: its scale differs from the rest
    bias = torch.randn(n)
    perm = cpu_qgemm_pack.group_order(iw)[0]
    xq = cpu_qgemm_pack.quantize_activations(x, gs, KINDS[kind], perm)
    y64 = xq @ _exact(iw, scales, mins).t() + bias.double()
    bound = (cpu_qgemm_pack.idot_error_bound(x, iw, scales, mins, KINDS[kind])
             + 2.0 ** -23 * y64.abs())
    y_port = cpu_qgemm_pack.linear(x, packed, bias, portable=True)
    assert bool(((y_port.double() - y64).abs() <= bound).all())
    if _vnni():
        y = cpu_qgemm_pack.linear(x, packed, bias)
        assert torch.equal(y, y_port)       # same integer sums, same fused float steps
    # the activations really are quantized: unquantized x is further off than the bound
    y_exact = x.double() @ _exact(iw, scales, mins).t() + bias.double()
    assert bool(((y_port.double() - y_exact).abs() > bound).any())


def test_int16_activations_are_finer_than_bf16_and_int8() -> None:
    """On one projection-sized weight, the error against the unquantized float64 product:
    int16 < bf16 < int8 (what the kernels' descriptions claim)."""
    iw, scales, mins = _weight(4, 576, 192, 32, "min", False, seed=11)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(2))
    y_exact = x.double() @ _exact(iw, scales, mins).t()
    err = {}
    for kind in ("bfloat16", "int16", "int8"):
        packed, _ = cpu_qgemm_pack.pack(iw, scales, mins, activations=kind)
        err[kind] = float((cpu_qgemm_pack.linear(x, packed, None, portable=True).double()
                           - y_exact).abs().mean())
    assert err["int16"] < err["bfloat16"] < err["int8"], err


def test_accumulate_strided_output_and_float32_scales() -> None:
    iw, scales, _ = _weight(8, 128, 48, 32, "zero", False, seed=3)
    s32 = scales.float() * (1 + 1e-6)
    packed, _ = cpu_qgemm_pack.pack(iw, s32, activations="int16")
    assert packed.scales.dtype == np.float32
    x = torch.randn(4, 128)
    for portable in (True, False):
        if not portable and not _vnni():
            continue
        out = torch.randn(4, 64)
        before = out.clone()
        cpu_qgemm.qgemm(x.numpy(), packed, out.numpy()[:, 8:], None, True, portable)
        y64 = cpu_qgemm_pack.quantize_activations(x, 32, 2) @ _exact(iw, s32, None).t()
        got = out[:, 8:56].double() - before[:, 8:56].double()
        bound = cpu_qgemm_pack.idot_error_bound(x, iw, s32, None, 2) + 1e-6
        assert bool(((got - y64).abs() <= bound).all())
        assert torch.equal(out[:, :8], before[:, :8]) and torch.equal(out[:, 56:], before[:, 56:])


def test_quantize_activations_rule() -> None:
    """The documented rule on a hand-made block: the largest value maps to +-T exactly."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 2.0, -1.0, 0.3
    q8 = cpu_qgemm_pack.quantize_activations(x, 32, 1)
    a = 2.0 / 127
    assert q8[0, 0] == pytest.approx(2.0) and q8[0, 1] == pytest.approx(a * round(-1.0 / a))
    assert q8[0, 2] == pytest.approx(a * round(0.3 / a))
    assert bool((q8[0, 3:] == 0).all())
    q16 = cpu_qgemm_pack.quantize_activations(x, 32, 2)
    assert abs(float(q16[0, 2]) - 0.3) <= 2.0 / 16383 / 2 + 1e-9
    assert cpu_qgemm_pack.activation_block(128) == 32
    assert cpu_qgemm_pack.activation_block(48) == 16
    assert cpu_qgemm_pack.activation_block(20) == 4
    with pytest.raises(ValueError, match="planes must be 1 or 2"):
        cpu_qgemm_pack.quantize_activations(x, 32, 3)
    with pytest.raises(ValueError, match="activations must be one of"):
        cpu_qgemm_pack.pack(*_weight(4, 64, 16, 32, "sym", False, 1)[:2], activations="fp8")


def _unit(jb: int, u: int, units: int, nb: int) -> int:
    """Byte offset of unit u of column block jb: K-major column blocks."""
    return 64 * (jb * units + u)


def test_vnni_packing_follows_the_documented_layout() -> None:
    """Bytes checked against idot.h's layout comment directly."""
    q = torch.randint(0, 16, (16, 176), dtype=torch.int32)     # K = 16, N = 176
    iw = IntWeight(q, torch.full((1, 176), 8, dtype=torch.int32), None, 16, 4)
    b = cpu_qgemm_pack.pack(iw, torch.ones(1, 176).half(), activations="int8")[0].packed
    for jb in range(11):
        for u in range(2):
            for c in range(16):
                for i in range(4):
                    byte = int(b[_unit(jb, u, 2, 11) + 4 * c + i])
                    assert byte & 15 == int(q[8 * u + i, 16 * jb + c])
                    assert byte >> 4 == int(q[8 * u + 4 + i, 16 * jb + c])
    q8 = torch.randint(0, 256, (8, 160), dtype=torch.int32)
    iw8 = IntWeight(q8, torch.full((1, 160), 128, dtype=torch.int32), None, 8, 8)
    b8 = cpu_qgemm_pack.pack(iw8, torch.ones(1, 160).half(), activations="int16")[0].packed
    for jb in range(10):
        for u in range(2):
            for c in range(16):
                for i in range(4):
                    want = int(q8[4 * u + i, 16 * jb + c])
                    assert int(b8[_unit(jb, u, 2, 10) + 4 * c + i]) == want


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_products_stay_exact(bits, kind, sign) -> None:
    """Every weight at its largest integer (15 / 255) and activations whose quantized bytes are
    the extremes: -128 in every low plane byte (int16: v = 256 h - 128), +-127 (int8). AVX2
    sums 16 such products per int16 lane (2 x 15 x 128 x 8 = 30720 < 2^15); the result must
    still equal the portable loop and the float64 oracle."""
    k, n, gs = 64, 32, 32
    q = torch.full((k, n), 2 ** bits - 1, dtype=torch.int32)
    iw = IntWeight(q, torch.full((k // gs, n), 2 ** (bits - 1), dtype=torch.int32), None, gs,
                   bits)
    scales = torch.full((k // gs, n), 0.01).half()
    packed, _ = cpu_qgemm_pack.pack(iw, scales, None, activations=kind)
    x = torch.full((3, k), sign * -16256.0 / 16383.0)  # int16: v = -16256 = 256 * -63 - 128
    x[:, 0] = sign                                        # the block's largest: v = +-16383
    x[1] = sign * -1.0                                    # int8: every v = +-127
    x[2, 32:] = 0.0                                       # an all-zero block
    xq = cpu_qgemm_pack.quantize_activations(x, gs, KINDS[kind])
    y64 = xq @ _exact(iw, scales, None).t()
    y_port = cpu_qgemm_pack.linear(x, packed, None, portable=True)
    bound = cpu_qgemm_pack.idot_error_bound(x, iw, scales, None, KINDS[kind]) + 1e-6
    assert bool(((y_port.double() - y64).abs() <= bound).all())
    if _vnni():
        assert torch.equal(cpu_qgemm_pack.linear(x, packed, None), y_port)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_activation_ties_round_half_to_even_on_every_path(kind) -> None:
    """Activations that land exactly half-way between two integers (x / a = j + 1/2) round to
    the even neighbour in the portable quantizer and in the vectorised one alike, so the
    outputs of the two paths stay equal bit for bit."""
    top = 127.0 if kind == "int8" else 16383.0
    iw, scales, mins = _weight(4, 64, 32, 32, "sym", False, seed=7)
    packed, _ = cpu_qgemm_pack.pack(iw, scales, mins, activations=kind)
    x = torch.zeros(2, 64)
    x[:, 0] = x[:, 32] = top                           # a = 1 in both blocks
    x[:, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5])
    x[:, 33:41] = torch.tensor([4.5, -4.5, 5.5, 6.5, -7.5, 8.5, 9.5, -10.5])
    xq = cpu_qgemm_pack.quantize_activations(x, 32, KINDS[kind])
    assert xq[0, 1:9].tolist() == [0, 2, 2, 0, -2, -2, 4, -4]
    y_port = cpu_qgemm_pack.linear(x, packed, None, portable=True)
    assert torch.allclose(y_port.double(), xq @ _exact(iw, scales, mins).t(), rtol=1e-5,
                          atol=1e-3)
    if _vnni():
        assert torch.equal(cpu_qgemm_pack.linear(x, packed, None), y_port)
