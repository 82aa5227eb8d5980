"""Triton GPTQ/AWQ dequant-GEMM vs an independent float64 oracle written from the format spec.

The oracle packs random integer weights with the spec's rules (docs/quant-formats.md §3.2,
§3.3, §4.2), then dequantizes the *packed* tensors with the spec's unpack formulas in int64 and
multiplies in float64. The spec's worked examples (§3.7, §4.4) pin the packers and the kernel's
AWQ interleave / GPTQ v1 "+1" handling to hand-checked words and values.
"""
from __future__ import annotations

import pytest
import torch

from nybble.kernels.triton.quant_gemm import awq_gemm, gptq_gemm

pytestmark = [pytest.mark.triton_interpret]

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def to_int32(words: list[int]) -> torch.Tensor:
    """uint32 bit patterns -> the signed int32 tensor a checkpoint stores."""
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def pack_fields(fields: torch.Tensor, bits: int, dim: int, order: list[int] | None = None):
    """Pack ``fields`` (non-negative ints) along ``dim``, field i = bits [b*i, b*i+b) (§1).

    ``order``: value ``order[i]`` of each run of 32/b goes into field i (AWQ interleave); the
    axis is zero-padded to whole words.
    """
    pf = 32 // bits
    f = fields.movedim(dim, -1).to(torch.int64)
    pad = (-f.shape[-1]) % pf
    f = torch.nn.functional.pad(f, (0, pad)).reshape(*f.shape[:-1], -1, pf)
    if order is not None:
        f = f[..., order]
    words = (f << (bits * torch.arange(pf))).sum(-1)  # fields do not overlap: sum == or
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, size: int,
           reverse: list[int] | None = None) -> torch.Tensor:
    """Spec unpack: ``value(i) = (word[i // pf] >> (b * pos(i % pf))) & mask`` along ``dim``."""
    pf, mask = 32 // bits, (1 << bits) - 1
    idx = torch.arange(size)
    pos = idx % pf if reverse is None else torch.tensor(reverse)[idx % 8]
    w = words.to(torch.int64).index_select(dim, idx // pf) & 0xFFFFFFFF  # uint32 view
    shape = [1] * w.dim()
    shape[dim] = size
    return (w >> (bits * pos).reshape(shape)) & mask


def gptq_oracle_weight(qweight, qzeros, scales, g_idx, bits, group_size, zero_offset, sym, k):
    """float64 ``Wt [K, N]`` from the packed GPTQ tensors (§3.5)."""
    n = qweight.shape[1]
    q = unpack(qweight, bits, 0, k)
    g = g_idx.long() if g_idx is not None else torch.arange(k) // (k if group_size == -1
                                                                   else group_size)
    if sym:
        z = torch.full((k, n), 1 << (bits - 1), dtype=torch.int64)
    else:
        z = (unpack(qzeros, bits, 1, n)[g] + zero_offset) & ((1 << bits) - 1)
    return (q - z).double() * scales.double()[g]


def awq_oracle_weight(qweight, qzeros, scales, group_size, k):
    n = scales.shape[1]
    g = torch.arange(k) // group_size
    q = unpack(qweight, 4, 1, n, AWQ_REVERSE_ORDER)
    z = unpack(qzeros, 4, 1, n, AWQ_REVERSE_ORDER)[g]
    return (q - z).double() * scales.double()[g]


def make_gptq(k, n, bits, group_size, sym, zero_offset, act_order):
    """Random GPTQ tensors (checkpoint layout) and their integer ground truth."""
    gs = k if group_size == -1 else group_size
    num_groups = -(-k // gs)
    mask = (1 << bits) - 1
    q = torch.randint(0, mask + 1, (k, n))
    z = torch.full((num_groups, n), 1 << (bits - 1)) if sym else \
        torch.randint(0, mask + 1, (num_groups, n))
    scales = (torch.rand(num_groups, n) * 0.02 + 0.005).half()
    g_idx = None
    if act_order:  # groups formed from consecutive positions of a permutation (§3.4)
        perm = torch.randperm(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    qweight = pack_fields(q, bits, 0)
    qzeros = pack_fields((z - zero_offset) & mask, bits, 1)  # v1 stores z - 1
    g = g_idx.long() if g_idx is not None else torch.arange(k) // gs
    truth = (q - z[g]).double() * scales.double()[g]
    return qweight, qzeros, scales, g_idx, truth


GPTQ_CASES = [
    # (bits, group_size, sym, zero_offset, act_order, dtype, M, K, N, bias)
    (4, 128, True, 1, False, torch.float16, 1, 256, 80, False),
    (4, 32, False, 1, False, torch.float32, 3, 256, 80, True),  # v1 asym, "+1" rule
    (4, 64, False, 0, False, torch.bfloat16, 33, 256, 80, False),  # v2 asym, tiled path
    (4, 32, False, 1, True, torch.float32, 33, 256, 80, True),  # act-order, tiled
    (4, 128, True, 0, True, torch.float16, 1, 256, 96, False),  # act-order g128 decode
    (4, -1, True, 0, False, torch.float32, 1, 256, 80, False),  # per-channel
    (8, 32, False, 0, True, torch.float16, 3, 256, 80, True),  # 8-bit act-order v2
    (8, 128, True, 1, False, torch.float32, 33, 256, 80, False),
    (8, -1, False, 1, False, torch.float32, 17, 256, 80, False),
    (4, 32, True, 1, False, torch.float32, 5, 64, 172, False),  # bundled model: gate/up
    (4, 32, False, 0, False, torch.float32, 5, 172, 64, True),  # down: K=172, padded word
]


@pytest.mark.parametrize("bits,group_size,sym,zero_offset,act_order,dtype,m,k,n,has_bias",
                         GPTQ_CASES)
def test_gptq_gemm(bits, group_size, sym, zero_offset, act_order, dtype, m, k, n, has_bias,
                   device):
    qweight, qzeros, scales, g_idx, truth = make_gptq(k, n, bits, group_size, sym, zero_offset,
                                                      act_order)
    # the oracle reads the packed tensors with the spec formulas; it must see the ground truth
    wt = gptq_oracle_weight(qweight, qzeros, scales, g_idx, bits, group_size, zero_offset, sym, k)
    assert torch.equal(wt, truth)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).half() if has_bias else None
    ref = x.double() @ wt + (bias.double() if has_bias else 0.0)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    dev = [t.to(device) if t is not None else None for t in (x, qweight, qzeros, scales, g_idx,
                                                              bias)]
    got = gptq_gemm(dev[0], dev[1], dev[2], dev[3], dev[4], bits, group_size, zero_offset, sym,
                    dev[5], out=out)
    assert got is out and got.dtype == dtype and not torch.isnan(got).any()
    err = (got.cpu().double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.3g}"


AWQ_CASES = [
    # (group_size, dtype, M, K, N)
    (32, torch.float16, 1, 128, 64),
    (64, torch.float32, 33, 256, 80),
    (128, torch.bfloat16, 3, 256, 96),
    (32, torch.float32, 5, 64, 172),  # bundled model shapes (N not a multiple of 8)
]


@pytest.mark.parametrize("group_size,dtype,m,k,n", AWQ_CASES)
def test_awq_gemm(group_size, dtype, m, k, n, device):
    num_groups = k // group_size
    q = torch.randint(0, 16, (k, n))
    z = torch.randint(0, 16, (num_groups, n))
    scales = (torch.rand(num_groups, n) * 0.02 + 0.005).half()
    qweight, qzeros = pack_fields(q, 4, 1, AWQ_ORDER), pack_fields(z, 4, 1, AWQ_ORDER)
    wt = awq_oracle_weight(qweight, qzeros, scales, group_size, k)
    g = torch.arange(k) // group_size
    assert torch.equal(wt, (q - z[g]).double() * scales.double()[g])
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    ref = x.double() @ wt + bias.double()
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    got = awq_gemm(x.to(device), qweight.to(device), qzeros.to(device), scales.to(device),
                   group_size, bias.to(device), out=out)
    assert not torch.isnan(got).any()
    err = (got.cpu().double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.3g}"


# ---- worked examples of docs/quant-formats.md §3.7 and §4.4 ---------------------------------
Q_EXAMPLE = (torch.arange(8)[:, None] + 2 * torch.arange(8)[None, :]) % 16  # q[k, n]
S_EXAMPLE = ((torch.arange(8) + 1) / 16).half()[None, :]  # s[n] = (n+1)/16, one group
GPTQ_QWEIGHT = [0x76543210, 0x98765432, 0xBA987654, 0xDCBA9876,
                0xFEDCBA98, 0x10FEDCBA, 0x3210FEDC, 0x543210FE]
AWQ_QWEIGHT = [0xEA62C840, 0xFB73D951, 0x0C84EA62, 0x1D95FB73,
               0x2EA60C84, 0x3FB71D95, 0x40C82EA6, 0x51D93FB7]


def dense_from_kernel(fn, device) -> torch.Tensor:
    """``Wt`` as the kernel sees it: multiply the identity (fp32, exact)."""
    return fn(torch.eye(8, device=device)).cpu().double()


def test_worked_example_packers():
    assert torch.equal(pack_fields(Q_EXAMPLE, 4, 0), to_int32(GPTQ_QWEIGHT)[None, :])
    assert torch.equal(pack_fields(Q_EXAMPLE, 4, 1, AWQ_ORDER), to_int32(AWQ_QWEIGHT)[:, None])
    q8 = pack_fields(torch.arange(8)[:, None] + 2 * torch.arange(8)[None, :], 8, 0)
    assert q8[0, 0] == 0x03020100 and q8[0, 1] == 0x05040302 and q8[1, 0] == 0x07060504
    z = torch.arange(8)[None, :]
    assert torch.equal(pack_fields(z, 4, 1), to_int32([0x76543210])[None, :])
    assert torch.equal(pack_fields(z, 4, 1, AWQ_ORDER), to_int32([0x75316420])[None, :])


@pytest.mark.parametrize("zeros_word,zero_offset,sym,z", [
    (0x77777777, 1, False, 8), (0x88888888, 0, False, 8),  # symmetric words, v1 / v2
    (0x12345678, 1, True, 8),  # sym: qzeros must be ignored
    (0x76543210, 1, False, None), (0x87654321, 0, False, None),  # asym z[n] = n + 1
])
def test_gptq_worked_example(zeros_word, zero_offset, sym, z, device):
    qweight = to_int32(GPTQ_QWEIGHT)[None, :].to(device)
    qzeros = to_int32([zeros_word])[None, :].to(device)
    wt = dense_from_kernel(lambda x: gptq_gemm(x, qweight, qzeros, S_EXAMPLE.to(device), None, 4,
                                               8, zero_offset, sym, None), device)
    zero = torch.arange(8)[None, :] + 1 if z is None else z
    assert torch.equal(wt, (Q_EXAMPLE - zero).double() * S_EXAMPLE.double())
    if z == 8:  # the spec's spot values, W = Wt^T
        assert wt[0, 0] == -0.5 and wt[0, 1] == -0.75 and wt[1, 7] == 3.5


def test_gptq_8bit_worked_example(device):
    q = torch.arange(8)[:, None] + 2 * torch.arange(8)[None, :]
    qweight = pack_fields(q, 8, 0).to(device)
    qzeros = to_int32([0x7F7F7F7F, 0x7F7F7F7F])[None, :].to(device)
    wt = dense_from_kernel(lambda x: gptq_gemm(x, qweight, qzeros, S_EXAMPLE.to(device), None, 8,
                                               -1, 1, False, None), device)
    assert torch.equal(wt, (q - 128).double() * S_EXAMPLE.double())


def test_awq_worked_example(device):
    qweight = to_int32(AWQ_QWEIGHT)[:, None].to(device)
    qzeros = to_int32([0x75316420])[None, :].to(device)
    wt = dense_from_kernel(lambda x: awq_gemm(x, qweight, qzeros, S_EXAMPLE.to(device), 8, None),
                           device)
    assert torch.equal(wt, (Q_EXAMPLE - torch.arange(8)[None, :]).double() * S_EXAMPLE.double())
    assert wt[0, 1] == 0.125  # W[1, 0] = 0.125 * (2 - 1)


def test_gptq_rejects_bad_bits(device):
    x = torch.randn(1, 8, device=device)
    w = torch.zeros(1, 8, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        gptq_gemm(x, w, w, torch.ones(1, 8, device=device), None, 3, -1, 0, True, None)


MINS_CASES = [
    # (bits, group_size, dtype, M, K, N): GGUF Q4_1/Q4_K (4-bit g32), Q5_1/Q5_K (8-bit g32)
    (4, 32, torch.float32, 1, 256, 80),    # decode, split-K
    (4, 32, torch.float16, 33, 256, 96),   # tiled
    (8, 32, torch.float32, 3, 128, 64),
    (8, 32, torch.bfloat16, 17, 256, 80),
]


@pytest.mark.parametrize("bits,group_size,dtype,m,k,n", MINS_CASES)
def test_gptq_gemm_float_minimums(bits, group_size, dtype, m, k, n, device):
    """``W = s * q + m`` (GGUF's minimum variant) against a float64 oracle from the integers."""
    g = k // group_size
    q = torch.randint(0, 1 << bits, (k, n))
    scales = torch.rand(g, n) * 0.02 + 0.005
    mins = -torch.rand(g, n) * 0.1
    qweight = pack_fields(q, bits, 0)
    qzeros = pack_fields(torch.randint(0, 1 << bits, (g, n)), bits, 1)  # must be ignored
    gi = torch.arange(k) // group_size
    wt = q.double() * scales.double()[gi] + mins.double()[gi]
    x = torch.randn(m, k).to(dtype)
    ref = x.double() @ wt
    dev = [t.to(device) for t in (x, qweight, qzeros, scales, mins)]
    got = gptq_gemm(dev[0], dev[1], dev[2], dev[3], None, bits, group_size, 0, False, None,
                    mins=dev[4])
    err = (got.cpu().double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.3g}"
    with pytest.raises(ValueError, match="mins must have the shape of scales"):
        gptq_gemm(dev[0], dev[1], dev[2], dev[3], None, bits, group_size, 0, False, None,
                  mins=dev[4][:1])
