"""Triton paged attention and reshape_and_cache vs the float64 torch oracle.

Oracle: :func:`nybble.kernels.reference.attention.paged_attention` run on float64 copies of
the inputs (attention), direct indexing (cache writes). Output buffers are poisoned with NaN
so an unwritten element fails the test.
"""
from __future__ import annotations

import pytest
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.reference.attention import paged_attention
from nybble.kernels.triton.backend import TritonAttentionBackend
from nybble.kernels.triton.cache import reshape_and_cache
from nybble.kernels.triton.paged_decode import paged_decode_attention
from nybble.kernels.triton.paged_prefill import paged_prefill_attention

pytestmark = [pytest.mark.triton_interpret]

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in float64."""
    diff = (out.double() - ref.double()).abs().max().item()
    return diff / ref.double().abs().max().item()


def make_batch(seqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, device: torch.device):
    """Random paged batch. ``seqs``: (cached prefix tokens, new tokens) per sequence.

    Blocks are handed out in a random order (block tables are not contiguous), tables are
    padded with -1, and the whole cache (including never-read slots) holds random values.
    """
    blocks_per_seq = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    max_blocks = max(blocks_per_seq) + 1  # one padding column at least
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    slots, qsl = [], [0]
    for b, ((ctx, q), nb) in enumerate(zip(seqs, blocks_per_seq)):
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        for pos in range(ctx, ctx + q):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    query = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q for _, q in seqs),
        max_seq_len=max(c + q for c, q in seqs),
        is_decode_only=all(q == 1 for _, q in seqs),
    )
    return query.to(device), kv_cache.to(device), meta


def oracle(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """float64 reference on CPU copies."""
    cpu = AttentionMetadata(meta.slot_mapping.cpu(), meta.query_start_loc.cpu(),
                            meta.seq_lens.cpu(), meta.block_tables.cpu(), meta.max_query_len,
                            meta.max_seq_len, meta.is_decode_only)
    return paged_attention(query.double().cpu(), kv_cache.double().cpu(), cpu, scale,
                           window=window, softcap=softcap)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output"
    err = rel_err(out.cpu(), ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(dtype, block_size, device):
    num_blocks, num_kv_heads, head_dim = 6, 4, 8
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    before = cache.clone()
    slots = torch.randperm(num_blocks * block_size)[:17]
    slots[[3, 11]] = -1  # padding tokens: must not be written
    key = torch.randn(17, num_kv_heads, head_dim).to(dtype).to(device)
    value = torch.randn(17, num_kv_heads, head_dim).to(dtype).to(device)
    reshape_and_cache(key, value, cache, slots.to(device))
    expect = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[0, s // block_size, s % block_size] = key[t]
            expect[1, s // block_size, s % block_size] = value[t]
    assert torch.equal(cache, expect)


def test_reshape_and_cache_strided_key(device):
    """Keys/values that are views into a fused qkv projection (non-contiguous)."""
    qkv = torch.randn(5, 3, 2, 16).to(device)
    cache = torch.randn(2, 2, 16, 2, 16).to(device)
    slots = torch.tensor([0, 17, 31, 5, 16], dtype=torch.int64, device=device)
    reshape_and_cache(qkv[:, 1], qkv[:, 2], cache, slots)
    flat = cache.view(2, 32, 2, 16)
    assert torch.equal(flat[0, slots], qkv[:, 1]) and torch.equal(flat[1, slots], qkv[:, 2])


def test_float32_model_on_a_bfloat16_cache(device):
    """``--kv-cache-dtype bfloat16`` under a float32 model: the write stores torch's
    round-to-nearest-even cast of the float32 keys and values; decode and prefill read the
    bfloat16 values and attend in float32 (float64 oracle on the cache as stored)."""
    query, kv_cache, meta = make_batch([(20, 1), (0, 5), (37, 1)], 16, 4, 2, 32,
                                       torch.float32, device)
    cache = kv_cache.to(torch.bfloat16)
    before = cache.clone()
    key = torch.randn(7, 2, 32, device=device)
    value = torch.randn(7, 2, 32, device=device)
    reshape_and_cache(key, value, cache, meta.slot_mapping)
    flat, slots = cache.view(2, -1, 2, 32), meta.slot_mapping
    assert torch.equal(flat[0, slots].view(torch.int16), key.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(flat[1, slots].view(torch.int16),
                       value.to(torch.bfloat16).view(torch.int16))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 32)[:, untouched])
    out = paged_prefill_attention(query, cache, meta, 32 ** -0.5)
    assert out.dtype == torch.float32
    check(out, oracle(query, cache, meta, 32 ** -0.5), torch.float32)


DECODE_CASES = [
    # (block_size, Hq, Hkv, D, dtype, context lengths, partition_size)
    (16, 8, 4, 8, torch.float32, [1, 15, 17, 33], None),  # bundled model: D 8, GQA 2
    (16, 4, 4, 16, torch.float32, [100, 1, 47], 32),  # GQA 1, many splits
    (32, 8, 2, 64, torch.float16, [33, 1, 130, 17], 32),  # GQA 4, head_dim 64
    (16, 8, 1, 32, torch.bfloat16, [70, 5], 16),  # GQA 8, MQA
]


@pytest.mark.parametrize("block_size,hq,hkv,d,dtype,ctx,partition", DECODE_CASES)
def test_paged_decode(block_size, hq, hkv, d, dtype, ctx, partition, device):
    query, kv_cache, meta = make_batch([(c - 1, 1) for c in ctx], block_size, hq, hkv, d, dtype,
                                       device)
    scale = d ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, kv_cache, meta, scale, out=out, partition_size=partition)
    check(out, oracle(query, kv_cache, meta, scale), dtype)


PREFILL_CASES = [
    # (block_size, Hq, Hkv, D, dtype, [(cached prefix, new tokens)])
    (16, 8, 4, 8, torch.float32, [(0, 1), (0, 15), (0, 17), (0, 33)]),  # plain prefill
    (32, 4, 1, 16, torch.float32, [(20, 1), (0, 17), (33, 15), (5, 1), (40, 33)]),  # mixed
    (16, 8, 2, 64, torch.float16, [(17, 16), (0, 33), (3, 1)]),  # chunked prefill + decode
    (32, 8, 8, 32, torch.bfloat16, [(1, 15), (31, 2)]),
]


@pytest.mark.parametrize("block_size,hq,hkv,d,dtype,seqs", PREFILL_CASES)
def test_paged_prefill(block_size, hq, hkv, d, dtype, seqs, device):
    query, kv_cache, meta = make_batch(seqs, block_size, hq, hkv, d, dtype, device)
    scale = d ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, kv_cache, meta, scale, out=out)
    check(out, oracle(query, kv_cache, meta, scale), dtype)


WINDOW_CASES = [
    # (window, softcap): shorter than the tiles and the prefixes, of one token, longer than
    # every sequence; soft-capping alone and with a window
    (5, None), (20, 1.5), (1, None), (None, 2.0), (200, None)]


@pytest.mark.parametrize("window,softcap", WINDOW_CASES)
def test_sliding_window_and_softcap(window, softcap, device):
    """Decode (many splits, some before the window) and mixed prefill batches."""
    scale = 16 ** -0.5
    decode = make_batch([(c - 1, 1) for c in (100, 1, 47, 9)], 16, 4, 2, 16, torch.float32,
                        device)
    prefill = make_batch([(20, 1), (0, 37), (33, 15), (40, 33)], 16, 4, 2, 16, torch.float32,
                         device)
    for (query, kv_cache, meta), run in ((decode, paged_decode_attention),
                                         (prefill, paged_prefill_attention)):
        out = torch.full_like(query, float("nan"))
        extra = {"partition_size": 16} if run is paged_decode_attention else {}
        run(query, kv_cache, meta, scale, out=out, window=window, softcap=softcap, **extra)
        check(out, oracle(query, kv_cache, meta, scale, window, softcap), torch.float32)


def test_prefill_kernel_serves_decode(device):
    """The varlen kernel alone must also be right on a decode-only batch."""
    query, kv_cache, meta = make_batch([(40, 1), (0, 1), (16, 1)], 16, 8, 2, 16,
                                       torch.float32, device)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, kv_cache, meta, 0.25, out=out)
    check(out, oracle(query, kv_cache, meta, 0.25), torch.float32)


@pytest.mark.parametrize("seqs", [[(0, 5), (12, 3), (30, 1)], [(4, 1), (33, 1)]])
def test_backend_end_to_end(seqs, device):
    """reshape_and_cache then forward (decode or varlen path) equals the torch backend."""
    hq, hkv, d = 8, 4, 8
    query, kv_cache, meta = make_batch(seqs, 16, hq, hkv, d, torch.float32, device)
    key = torch.randn(query.shape[0], hkv, d, device=device)
    value = torch.randn(query.shape[0], hkv, d, device=device)
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    backend.reshape_and_cache(key, value, kv_cache, meta)
    flat = kv_cache.view(2, -1, hkv, d)
    assert torch.equal(flat[0, meta.slot_mapping], key)
    out = backend.forward(query, kv_cache, meta, d ** -0.5)
    check(out, oracle(query, kv_cache, meta, d ** -0.5), torch.float32)


def test_decode_rejects_prefill_batch(device):
    query, kv_cache, meta = make_batch([(0, 3)], 16, 4, 4, 8, torch.float32, device)
    with pytest.raises(ValueError, match="one new token"):
        paged_decode_attention(query, kv_cache, meta, 1.0)
