"""Quantized KV cache (int8 / fp8 e4m3, per-head scales): writes and attention, torch
reference and Triton kernels, against formulas written here and the float64 oracle.

The oracle models the quantization: it runs the float64 reference attention on the cache the
quantized one *represents* (``float64(q) * scale``, decoded here from the stored bytes), so
the kernels' only allowed error is their arithmetic, not the quantization.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.kernels.kv_quant import QMAX, KeySmoothing, quantize_kv
from nybble.kernels.reference.attention import TorchAttentionBackend, reshape_and_cache
from tests.kernels.triton.test_attention import make_batch, oracle, rel_err

QDTYPES = [torch.int8, torch.float8_e4m3fn]


def e4m3_grid() -> torch.Tensor:
    """Every finite float8 e4m3fn value, from its 256 bit patterns (OCP FP8 spec), float64."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    return values[torch.isfinite(values)].unique()


def expected_codes(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values a cache of ``dtype`` must hold for ``x [T, H, D]``, as float64: int8 rounds
    half up and clamps to +-127; fp8 takes the nearest e4m3 value (ties to the even code),
    saturated at +-448."""
    y = x.double() / scale.double().view(1, -1, 1)
    if dtype == torch.int8:
        return torch.floor(y + 0.5).clamp(-127, 127)
    y = y.clamp(-448, 448)
    grid = e4m3_grid()
    dist = (y.reshape(-1, 1) - grid.view(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = dist == best
    # among equally near values, the one whose code is even (its last mantissa bit is 0)
    even = (grid.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32) % 2 == 0)
    pick = torch.where(ties & even.view(1, -1), 1, 0) * 2 + ties.int()
    return grid[pick.argmax(dim=1)].view(y.shape)


def stored(cache: torch.Tensor) -> torch.Tensor:
    """The values a quantized cache holds, float64 (before the scales)."""
    return cache.double()


def represented(cache: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[2, NB, BS, Hkv, D]``: what the quantized cache stands for."""
    return stored(cache.cpu()) * kv_scale.cpu().double().view(2, 1, 1, -1, 1)


def quantized_batch(seqs, block_size, hq, hkv, d, qdtype, device, query_dtype=torch.float32):
    """A random paged batch whose cache is quantized with random per-head scales."""
    query, float_cache, meta = make_batch(seqs, block_size, hq, hkv, d, query_dtype, device)
    kv_scale = (torch.rand(2, hkv) * 0.03 + 0.01).to(device)  # heads differ in range
    float_cache = float_cache.float() * torch.linspace(0.5, 3.0, hkv).view(1, 1, 1, hkv, 1)
    cache = torch.stack([quantize_kv(float_cache[i].reshape(-1, hkv, d).cpu(),
                                     kv_scale[i].cpu(), qdtype).view(float_cache[i].shape)
                         for i in range(2)]).to(device)
    return query, cache, kv_scale, meta


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_matches_the_formula(qdtype):
    x = torch.randn(40, 3, 16) * torch.tensor([0.5, 4.0, 30.0]).view(1, 3, 1)
    x[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # saturation both ways, zeros
    scale = torch.tensor([0.01, 0.05, 0.2])
    q = quantize_kv(x, scale, qdtype)
    assert q.dtype == qdtype
    assert torch.equal(q.double(), expected_codes(x, scale, qdtype))
    assert q.double().abs().max() <= QMAX[qdtype]


def test_quantize_rejects_a_float_dtype():
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        quantize_kv(torch.ones(1, 1, 2), torch.ones(1), torch.float16)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_reference_write_stores_quantized_values(qdtype):
    nb, bs, hkv, d = 5, 16, 2, 8
    cache = torch.zeros(2, nb, bs, hkv, d, dtype=qdtype)
    kv_scale = torch.tensor([[0.02, 0.1], [0.05, 0.01]])
    key, value = torch.randn(9, hkv, d), torch.randn(9, hkv, d)
    slots = torch.tensor([0, 17, 31, 5, -1, 16, 79, 40, 3])
    reshape_and_cache(key, value, cache, slots, kv_scale)
    flat = cache.view(torch.uint8).view(2, nb * bs, hkv, d)
    keep = slots >= 0
    got_k = flat[0, slots[keep]].view(qdtype).double()
    got_v = flat[1, slots[keep]].view(qdtype).double()
    assert torch.equal(got_k, expected_codes(key[keep], kv_scale[0], qdtype))
    assert torch.equal(got_v, expected_codes(value[keep], kv_scale[1], qdtype))
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[keep]] = True
    assert not flat[:, ~written].any()  # nothing else written


REF_CASES = [
    # (block_size, Hq, Hkv, D, [(cached prefix, new tokens)])
    (16, 4, 2, 8, [(0, 1), (15, 1), (40, 1)]),          # decode only
    (16, 8, 2, 16, [(0, 17), (33, 15), (5, 1)]),         # prefill, chunked, and a decode row
]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size,hq,hkv,d,seqs", REF_CASES)
def test_reference_attention_reads_through_the_scales(qdtype, block_size, hq, hkv, d, seqs):
    query, cache, kv_scale, meta = quantized_batch(seqs, block_size, hq, hkv, d, qdtype,
                                                   torch.device("cpu"))
    out = TorchAttentionBackend().forward(query, cache, meta, d ** -0.5, kv_scale)
    ref = oracle(query, represented(cache, kv_scale), meta, d ** -0.5)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


def test_reference_needs_scales_for_a_quantized_cache():
    query, cache, _, meta = quantized_batch([(3, 1)], 16, 2, 2, 8, torch.int8,
                                            torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_scale must be"):
        TorchAttentionBackend().forward(query, cache, meta, 0.3)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size,hq,hkv,d", [(16, 4, 2, 8), (8, 6, 3, 64), (16, 8, 1, 20)])
def test_cpu_decode_kernel_reads_through_the_scales(qdtype, block_size, hq, hkv, d):
    """The Cython decode kernel on a quantized cache (its bytes, a byte table, per-head
    scales) against the float64 oracle on the cache it represents."""
    from nybble.kernels.cpu.backend import CpuAttentionBackend, cpu_kernel_available

    if not cpu_kernel_available():
        pytest.skip("the CPU kernel extension is not built")
    query, cache, kv_scale, meta = quantized_batch(
        [(0, 1), (6, 1), (block_size, 1), (3 * block_size + 4, 1)], block_size, hq, hkv, d,
        qdtype, torch.device("cpu"))
    backend = CpuAttentionBackend()
    assert backend._uses_kernel(meta, cache)
    out = backend.forward(query, cache, meta, d ** -0.5, kv_scale)
    ref = oracle(query, represented(cache, kv_scale), meta, d ** -0.5)
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="kv_scale must be"):
        backend.forward(query, cache, meta, d ** -0.5)


def test_cpu_decode_kernel_checks_its_byte_arguments():
    from nybble.kernels.cpu.backend import cpu_kernel_available

    if not cpu_kernel_available():
        pytest.skip("the CPU kernel extension is not built")
    from nybble.kernels.cpu.attention import paged_decode_attention

    cache = np.zeros((2, 2, 16, 2, 8), np.uint8)
    args = (np.zeros((1, 2, 8), np.float32), cache, np.zeros((1, 2), np.int32),
            np.ones(1, np.int32), 0.3, np.zeros((1, 2, 8), np.float32),
            np.zeros(64, np.float32))
    with pytest.raises(ValueError, match=r"needs kv_scale \[2, 2\] float32"):
        paged_decode_attention(*args)
    with pytest.raises(ValueError, match=r"needs kv_scale"):
        paged_decode_attention(*args, np.ones((2, 3), np.float32), np.zeros(256, np.float32))
    with pytest.raises(ValueError, match=r"uint8 \(fp8\) kv_cache needs byte_values \[256\]"):
        paged_decode_attention(*args, np.ones((2, 2), np.float32))
    int8_args = (args[0], cache.view(np.int8)) + args[2:]
    with pytest.raises(ValueError, match=r"needs kv_scale \[2, 2\] float32"):
        paged_decode_attention(*int8_args)


# ------------------------------------------------------------- Triton (interpreter on CPU)
@pytest.mark.triton_interpret
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16])
def test_triton_write_equals_the_reference(qdtype, key_dtype, device):
    from nybble.kernels.triton.cache import reshape_and_cache as triton_write

    nb, bs, hkv, d = 4, 16, 3, 8
    kv_scale = torch.tensor([[0.02, 0.1, 0.5], [0.05, 0.01, 0.3]], device=device)
    key = (torch.randn(11, hkv, d) * 5).to(key_dtype).to(device)
    value = (torch.randn(11, hkv, d) * 5).to(key_dtype).to(device)
    key[0, 0, 0] = 1e4  # saturates
    slots = torch.tensor([0, 17, 31, 5, -1, 16, 63, 40, 3, 8, 9], device=device)
    got = torch.zeros(2, nb, bs, hkv, d, dtype=qdtype, device=device)
    triton_write(key, value, got, slots, kv_scale)
    want = torch.zeros(2, nb, bs, hkv, d, dtype=qdtype)
    reshape_and_cache(key.cpu(), value.cpu(), want, slots.cpu(), kv_scale.cpu())
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.triton_interpret
def test_triton_write_needs_scales(device):
    from nybble.kernels.triton.cache import reshape_and_cache as triton_write

    cache = torch.zeros(2, 1, 16, 2, 8, dtype=torch.int8, device=device)
    kv = torch.ones(1, 2, 8, device=device)
    with pytest.raises(ValueError, match=r"kv_scale must be a \[2, 2\] float32"):
        triton_write(kv, kv, cache, torch.zeros(1, dtype=torch.int64, device=device))


TRITON_CASES = [
    # (block_size, Hq, Hkv, D, query dtype, [(cached prefix, new tokens)])
    (16, 4, 2, 16, torch.float32, [(0, 1), (20, 1), (47, 1)]),      # decode
    (16, 8, 2, 16, torch.float16, [(16, 1), (70, 1)]),              # decode, fp16, GQA 4
    (16, 4, 2, 16, torch.float32, [(0, 17), (20, 5), (3, 1)]),      # prefill + chunk + decode
    (32, 4, 4, 16, torch.float16, [(33, 15), (0, 9)]),
]


@pytest.mark.triton_interpret
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size,hq,hkv,d,qdt,seqs", TRITON_CASES)
def test_triton_attention_reads_through_the_scales(qdtype, block_size, hq, hkv, d, qdt, seqs,
                                                   device):
    from nybble.kernels.triton.backend import TritonAttentionBackend

    query, cache, kv_scale, meta = quantized_batch(seqs, block_size, hq, hkv, d, qdtype,
                                                   device, qdt)
    out = TritonAttentionBackend().forward(query, cache, meta, d ** -0.5, kv_scale)
    ref = oracle(query, represented(cache, kv_scale), meta, d ** -0.5)
    assert out.dtype == qdt and not torch.isnan(out).any()
    tol = 1e-5 if qdt == torch.float32 else 1e-2
    assert rel_err(out.cpu(), ref) < tol


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int
                       ) -> torch.Tensor:
    """float64 ``softmax(q k^T) v`` of one sequence, ``q [T, Hq, D]``, ``k/v [S, Hkv, D]``,
    query head ``i`` reading KV head ``i // group`` (no mask: every query sees every key)."""
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k)
    return torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_key_smoothing_leaves_attention_unchanged(hq: int, hkv: int) -> None:
    """Stored keys ``(k - shift) / factor`` read by queries ``q * factor`` give the same
    attention as ``q`` on ``k``, exactly up to float64 rounding: the product changes by
    ``q . shift``, the same for every key of a query, which softmax removes."""
    g = torch.Generator().manual_seed(0)
    d = 8
    q = torch.randn(5, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(11, hkv, d, generator=g, dtype=torch.float64) * 3 + 2
    v = torch.randn(11, hkv, d, generator=g, dtype=torch.float64)
    shift = torch.randn(hkv, d, generator=g)
    factor = torch.rand(hkv, d, generator=g).clamp(min=0.05)
    smooth = KeySmoothing(shift, factor, hq // hkv)
    assert smooth.q_factor.shape == (hq, d)
    stored_keys, read_queries = smooth.keys(k), smooth.queries(q)
    assert stored_keys.dtype == read_queries.dtype == torch.float64
    assert torch.allclose(stored_keys, (k - shift.double()) / factor.double(), rtol=1e-6)
    want = _softmax_attention(q, k, v, hq // hkv)
    got = _softmax_attention(read_queries, stored_keys, v, hq // hkv)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    # a shift alone changes the scores themselves, by q . shift per query (and KV head)
    assert not torch.allclose(torch.einsum("thd,shd->ths", q[:, ::hq // hkv], k),
                              torch.einsum("thd,shd->ths", q[:, ::hq // hkv],
                                           stored_keys * factor.double()))


def test_key_smoothing_rejects_bad_shapes_and_factors() -> None:
    with pytest.raises(ValueError, match="shift and factor must both be"):
        KeySmoothing(torch.zeros(2, 8), torch.ones(2, 4), 1)
    with pytest.raises(ValueError, match=r"factor must lie in \(0, 1\]"):
        KeySmoothing(torch.zeros(2, 8), torch.full((2, 8), 1.5), 1)
    with pytest.raises(ValueError, match=r"factor must lie in \(0, 1\]"):
        KeySmoothing(torch.zeros(2, 8), torch.zeros(2, 8), 1)
