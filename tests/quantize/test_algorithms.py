"""GPTQ / AWQ / RTN against independent oracles (docs/quant-formats.md §7)."""
from __future__ import annotations

import torch
from torch import nn

from nybble.kernels.cpu import weight_only as cpu_weight_only
from nybble.kernels.reference.quant import dequantize_gptq
from nybble.quant.linear import GPTQLinear
from nybble.quantize import awq
from nybble.quantize.export import pack_gptq
from nybble.quantize.gptq import HessianAccumulator, gptq_quantize
from nybble.quantize.qparams import get_group_qparams
from nybble.quantize.rtn import rtn_quantize


def _inputs(t: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs (low-rank mixing) with a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 8, generator=g) @ torch.randn(8, k, generator=g)
    x = x + 0.1 * torch.randn(t, k, generator=g)
    x[:, :4] *= 20.0
    return x


def _err(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x.double() @ w.double().t() - x.double() @ q.double().t()).norm())


def test_qparams_formulas() -> None:
    w = torch.tensor([[-1.0, 0.5, 2.0, 3.0], [0.2, 0.4, 0.6, 0.8]])
    s, z = get_group_qparams(w, 4, 4, sym=False)  # gptq: zero forced into range
    assert torch.allclose(s[:, 0], torch.tensor([4.0 / 15, 0.8 / 15]).half().float())
    assert z[1, 0] == 0 and z[0, 0] == torch.round(1.0 / s[0, 0])
    s, z = get_group_qparams(w, 4, 4, sym=True)
    assert torch.allclose(s[0, 0], torch.tensor(6.0 / 15).half().float()) and z[0, 0] == 8
    s, z = get_group_qparams(w, 4, 4, sym=False, kind="awq")  # range not through zero
    assert torch.allclose(s[1, 0], torch.tensor(0.6 / 15).half().float())
    assert z[1, 0] == torch.clamp(-torch.round(0.2 / s[1, 0]), 0, 15)


def test_gptq_beats_rtn_on_correlated_outliers() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    x = _inputs(2048, 128, 1)
    acc = HessianAccumulator(128)
    for chunk in x.split(256):
        acc.add_batch(chunk.unsqueeze(0))
    for sym, desc in ((True, False), (False, True)):
        res = gptq_quantize(w, acc.h, 4, 32, sym, desc_act=desc)
        rtn = rtn_quantize(w, 4, 32, sym)
        assert _err(x, w, res.dequant) < 0.7 * _err(x, w, rtn.dequant)
        # the packed GPTQ tensors decode to exactly the dequantized result (fp16 rounding)
        t = pack_gptq(res, 4, v2=not sym)
        deq = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32,
                              0 if not sym else 1, sym)
        assert torch.equal(deq, res.dequant.half())


def test_gptq_with_identity_hessian_is_rtn() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    res = gptq_quantize(w, torch.eye(64) * 3.0, 4, 32, sym=False)
    rtn = rtn_quantize(w, 4, 32, sym=False)
    assert torch.equal(res.q, rtn.q) and torch.equal(res.scale, rtn.scale)


def test_gptq_invariant_to_hessian_scale() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    x = _inputs(512, 64, 4)
    h = x.t() @ x
    a = gptq_quantize(w, h, 4, 16, sym=True, desc_act=True)
    b = gptq_quantize(w, h * 8.0, 4, 16, sym=True, desc_act=True)
    assert (a.q == b.q).float().mean() > 0.99
    # act-order g_idx: every group has exactly group_size members
    assert torch.equal(torch.bincount(a.g_idx.long()), torch.full((4,), 16))


def test_awq_beats_rtn_with_salient_channels() -> None:
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(128, 64, bias=False)
    lin.weight.data = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(1024, 128, generator=g)
    x[:, [3, 40, 77, 100]] *= 30.0
    w0 = lin.weight.detach().clone()
    y_ref = x @ w0.t()
    c = awq.search_best_scale(x, [lin], lin, 4, 32, duo_scaling=True)
    s, alpha, losses = c.s, c.alpha, c.losses
    assert torch.equal(lin.weight, w0)  # restored from a real copy
    assert len(losses) == 20 and c.duo
    assert min(losses) == losses[round(alpha * 20)] and losses[round(alpha * 20)] <= losses[0]
    both = awq.search_best_scale(x, [lin], lin, 4, 32, duo_scaling="both")
    assert both.losses[:20] == losses and len(both.losses) == 40
    assert min(both.losses) == both.losses[round(both.alpha * 20) + (0 if both.duo else 20)]
    assert min(both.losses) <= min(losses)
    norm = nn.Module()
    norm.weight = nn.Parameter(torch.ones(128))
    awq.apply_scale(norm, [lin], s)
    # function preserving before quantization
    torch.testing.assert_close((x / s) @ lin.weight.t(), y_ref, atol=1e-4, rtol=1e-4)
    q_awq = rtn_quantize(lin.weight.data, 4, 32, False, kind="awq").dequant
    err_awq = float(((x / s) @ q_awq.t() - y_ref).norm())
    err_rtn = float((x @ rtn_quantize(w0, 4, 32, False, kind="awq").dequant.t() - y_ref).norm())
    assert err_awq < 0.8 * err_rtn


def test_awq_clip_never_worse_than_no_clip() -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 64, generator=g)
    w[0, 0] = 12.0
    x = torch.randn(300, 64, generator=g)
    bounds = awq.search_best_clip(w, x, 4, 32)
    assert bounds.shape == (64, 2, 2)
    lin = nn.Linear(64, 64, bias=False)
    lin.weight.data = w.clone()
    awq.apply_clip(lin, bounds, 32)

    def group_err(wc: torch.Tensor) -> torch.Tensor:
        q = rtn_quantize(wc, 4, 32, False, kind="awq").dequant
        d = (x.view(-1, 1, 2, 32) * (q - w).view(1, 64, 2, 32)).sum(-1)
        return d.pow(2).mean(0)

    assert bool((group_err(lin.weight.data) <= group_err(w) + 1e-6).all())
    # the ends move independently: the outlier group keeps its 12.0 top (a clipped outlier
    # costs more than the coarser steps) and gives up part of its bottom instead
    assert bounds[0, 0, 1] == 12.0 and bounds[0, 0, 0] > w[0, :32].min()
    shrink = 1 - bounds / torch.stack([w.view(64, 2, 32).amin(2), w.view(64, 2, 32).amax(2)], 2)
    assert int(((shrink[..., 0] - shrink[..., 1]).abs() > 1e-6).sum()) > 0
    wg = lin.weight.data.view(64, 2, 32)
    assert torch.equal(wg.amin(2), bounds[..., 0]) and torch.equal(wg.amax(2), bounds[..., 1])


def test_quant_linear_matches_float64_reference() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=g)
    res = rtn_quantize(w, 8, 32, sym=False)
    t = pack_gptq(res, 8, v2=True)
    mod = GPTQLinear(64, 48, False, torch.float32, torch.device("cpu"), 8, 32, 0, False)
    mod.load_tensors(t)
    x = torch.randn(3, 90, 64, generator=g)  # 270 rows > KERNEL_ROWS: the reference path
    assert 270 > cpu_weight_only.KERNEL_ROWS
    ref = x.double() @ (res.dequant.half().double()).t()
    torch.testing.assert_close(mod(x).double(), ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mod(x.double()), ref, atol=1e-12, rtol=0)
    # decode-sized calls take the CPU int8 kernel, within its documented bound
    assert mod.cpu_weight is not None
    x1 = x[0, :2]
    err = (mod(x1).double() - ref[0, :2]).abs()
    bound = cpu_weight_only.error_bound(x1, mod.int_weight(), mod.scales, ref[0, :2])
    assert bool((err <= bound).all()) and float(err.max()) > 0
