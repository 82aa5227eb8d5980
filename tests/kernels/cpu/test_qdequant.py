"""The prefill path's dequantization of a packed CPU weight to bfloat16
(nybble/kernels/cpu/qdequant.h, ``qgemm_pack.dequantize_bf16``) against the format's rule in
float64, and ``qgemm_pack.prefill_linear`` against the float64 product: both packed layouts
(integer-dot "vnni" and bf16-dot), 4/8 bits, symmetric / integer-zero / float-minimum
weights, act order, column counts that are not a multiple of 16, one and three threads."""
from __future__ import annotations

import pytest
import torch

from nybble.kernels.cpu import qgemm as cpu_qgemm
from nybble.kernels.cpu import qgemm_pack as cpu_qgemm_pack

from .test_qgemm import _exact, _weight

CASES = [(4, 64, 40, 32), (4, 576, 200, 32), (4, 96, 33, 64), (8, 64, 40, 32),
         (8, 100, 24, 20)]


@pytest.mark.parametrize("bits,k,n,gs", CASES)
@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
@pytest.mark.parametrize("activations", ["int16", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_dequant_bf16_is_the_rounded_exact_weight(bits, k, n, gs, mode, activations,
                                                  threads) -> None:
    if gs % 4:
        pytest.skip("the integer-dot layout needs groups of a multiple of 4")
    act_order = k == 96
    iw, scales, mins = _weight(bits, k, n, gs, mode, act_order, seed=k + n + bits)
    packed, why = cpu_qgemm_pack.pack(iw, scales, mins, activations=activations)
    if packed is None:
        pytest.skip(why)
    assert (packed.planes > 0) == (activations == "int16")
    before = cpu_qgemm.get_threads()
    cpu_qgemm.set_threads(threads)
    try:
        got = cpu_qgemm_pack.dequantize_bf16(packed)
    finally:
        cpu_qgemm.set_threads(before)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    exact = _exact(iw, scales, mins)                                  # [N, K] float64
    if mode == "min":   # stored as s (q - o) + (m + o s): float32 roundings before bf16's
        err = (got.double() - exact).abs()
        assert bool((err <= 2.0 ** -8 * exact.abs() + 2.0 ** -20).all())
    else:               # s (q - z) is one float32 product: bit-exact after rounding
        assert torch.equal(got, exact.float().to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
def test_prefill_linear_matches_float64_product_of_rounded_operands(mode) -> None:
    iw, scales, mins = _weight(4, 576, 200, 32, mode, False, seed=5)
    packed, _ = cpu_qgemm_pack.pack(iw, scales, mins, activations="int16")
    x = torch.randn(150, 576, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(200)
    y = cpu_qgemm_pack.prefill_linear(x, packed, bias).double()
    w16 = cpu_qgemm_pack.dequantize_bf16(packed).double()
    y64 = cpu_qgemm_pack.round_bf16(x).double() @ w16.t()
    # float32 sums, then the output rounded to bfloat16 (relative 2^-8 at worst), + bias
    bound = 2.0 ** -8 * y64.abs() + 576 * 2.0 ** -23 * (x.abs().double() @ w16.abs().t()) + 1e-6
    assert bool(((y - bias.double() - y64).abs() <= bound + 2.0 ** -20 * bias.abs()).all())
    # and it is the layer: within bf16 rounding of the exact float64 product
    exact = x.double() @ _exact(iw, scales, mins).t() + bias.double()
    assert float((y - exact).abs().max()) < 0.02 * float(exact.abs().max())
    with pytest.raises(ValueError, match="x must be"):
        cpu_qgemm_pack.prefill_linear(x[:, :100], packed, None)


def test_dequant_bf16_checks_the_output_shape() -> None:
    iw, scales, _ = _weight(4, 64, 40, 32, "sym", False, seed=1)
    packed, _ = cpu_qgemm_pack.pack(iw, scales, None)
    import numpy as np
    with pytest.raises(ValueError, match=r"out must be \[40, 64\]"):
        cpu_qgemm.dequant_bf16(packed, np.empty((40, 63), np.uint16))


@pytest.mark.parametrize("bits,k,n,gs", CASES)
@pytest.mark.parametrize("mode", ["sym", "zero", "min"])
@pytest.mark.parametrize("activations", ["int16", "bfloat16"])
def test_dequant_f32_is_the_exact_weight(bits, k, n, gs, mode, activations) -> None:
    """float32 dequantization: ``s (q - z)`` is one float32 product of exact integers, so it
    equals the float64 rule rounded to float32; a float minimum is stored as
    ``s (q - o) + (m + o s)`` (two float32 roundings)."""
    if gs % 4:
        pytest.skip("the integer-dot layout needs groups of a multiple of 4")
    iw, scales, mins = _weight(bits, k, n, gs, mode, k == 96, seed=k + n + bits + 1)
    packed, why = cpu_qgemm_pack.pack(iw, scales, mins, activations=activations)
    if packed is None:
        pytest.skip(why)
    got = cpu_qgemm_pack.dequantize_f32(packed)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    exact = _exact(iw, scales, mins)
    if mode == "min":
        assert bool(((got.double() - exact).abs() <= 2.0 ** -22 * exact.abs().clamp(min=1.0)
                     * 4 + 2.0 ** -30).all())
    else:
        assert torch.equal(got, exact.float())
    # its rounding to bfloat16 is the bf16 dequantization
    assert torch.equal(got.to(torch.bfloat16), cpu_qgemm_pack.dequantize_bf16(packed))


def test_prefill_linear_float32_is_the_exact_product() -> None:
    iw, scales, mins = _weight(4, 576, 200, 32, "zero", False, seed=7)
    packed, _ = cpu_qgemm_pack.pack(iw, scales, mins, activations="int16")
    x = torch.randn(150, 576, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(200)
    y = cpu_qgemm_pack.prefill_linear(x, packed, bias, "float32").double()
    exact = x.double() @ _exact(iw, scales, mins).t() + bias.double()
    bound = 600 * 2.0 ** -23 * (x.double().abs() @ _exact(iw, scales, mins).abs().t()
                                + bias.double().abs())
    assert bool(((y - exact).abs() <= bound).all())
    with pytest.raises(ValueError, match="dtype must be one of"):
        cpu_qgemm_pack.prefill_linear(x, packed, None, "float16")
