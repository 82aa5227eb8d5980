"""The Cython CPU paged decode kernel against a naive float64 per-sequence, per-head softmax
attention written from the definition, and the CPU backend against the torch reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.kernels.cpu.backend import CpuAttentionBackend, cpu_kernel_available
from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.reference.attention import TorchAttentionBackend

from tests.kernels.reference.test_attention import _naive

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="extension not built")

if cpu_kernel_available():
    from nybble.kernels.cpu.attention import paged_decode_attention


def _decode_batch(lens: list[int], block_size: int, hq: int, hkv: int, d: int):
    """A random decode batch: cache [2, NB, BS, Hkv, D] float32 holding each sequence's
    keys/values through a shuffled block table, queries [B, Hq, D]; returns it and the
    float64 per-sequence keys/values."""
    gen = torch.Generator().manual_seed(sum(lens) + hq)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.zeros(2, num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lens)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lens):
        k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        for j in range(-(-n // block_size)):
            blk = perm.pop()
            tables[b, j] = blk
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            cache[0, blk, : rows.stop - rows.start] = k[rows]
            cache[1, blk, : rows.stop - rows.start] = v[rows]
        ks.append(k.double())
        vs.append(v.double())
    query = torch.randn(len(lens), hq, d, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, max_query_len=1,
        max_seq_len=max(lens), is_decode_only=True)
    return query, cache, meta, ks, vs


@pytest.mark.parametrize("block_size,hq,hkv,d", [(16, 8, 4, 8), (8, 4, 4, 16), (16, 6, 2, 64),
                                                 (32, 8, 1, 8)])
def test_kernel_matches_float64_definition(block_size: int, hq: int, hkv: int, d: int) -> None:
    lens = [1, 17, block_size, 3 * block_size + 5, 40]
    query, cache, meta, ks, vs = _decode_batch(lens, block_size, hq, hkv, d)
    out = np.full((len(lens), hq, d), np.nan, np.float32)
    scratch = np.empty(hq * (max(lens) + d + 1), np.float32)
    paged_decode_attention(query.numpy(), cache.numpy(), meta.block_tables.numpy(),
                           meta.seq_lens.numpy(), d ** -0.5, out, scratch)
    want = torch.cat([_naive(query[b:b + 1].double(), ks[b], vs[b], 1)
                      for b in range(len(lens))])
    torch.testing.assert_close(torch.from_numpy(out).double(), want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (5, 2.0), (0, 1.5), (1, 0.0),
                                            (100, 0.0)])
def test_kernel_sliding_window_and_softcap(window: int, softcap: float) -> None:
    """A window shorter than most sequences (starting inside a block), of one token, longer
    than all; soft-capping alone and with a window."""
    lens = [1, 17, 16, 3 * 16 + 5, 40]
    query, cache, meta, ks, vs = _decode_batch(lens, 16, 8, 2, 8)
    out = np.full((len(lens), 8, 8), np.nan, np.float32)
    scratch = np.empty(8 * (max(lens) + 8 + 1), np.float32)
    paged_decode_attention(query.numpy(), cache.numpy(), meta.block_tables.numpy(),
                           meta.seq_lens.numpy(), 8 ** -0.5, out, scratch, window=window,
                           softcap=softcap)
    want = torch.cat([_naive(query[b:b + 1].double(), ks[b], vs[b], 1, window or None,
                             softcap or None) for b in range(len(lens))])
    torch.testing.assert_close(torch.from_numpy(out).double(), want, atol=2e-6, rtol=0)


def test_kernel_reads_strided_queries() -> None:
    """q as the model passes it: heads of a wider row (q and k rotated together)."""
    query, cache, meta, ks, vs = _decode_batch([5, 30], 16, 8, 4, 8)
    wide = torch.randn(2, 12, 8)
    wide[:, :8] = query
    out = np.empty((2, 8, 8), np.float32)
    paged_decode_attention(wide[:, :8].numpy(), cache.numpy(), meta.block_tables.numpy(),
                           meta.seq_lens.numpy(), 8 ** -0.5, out, np.empty(400, np.float32))
    want = torch.cat([_naive(query[b:b + 1].double(), ks[b], vs[b], 1) for b in range(2)])
    torch.testing.assert_close(torch.from_numpy(out).double(), want, atol=2e-6, rtol=0)


def test_kernel_rejects_bad_input() -> None:
    query, cache, meta, _, _ = _decode_batch([5, 30], 16, 8, 4, 8)
    args = (query.numpy(), cache.numpy(), meta.block_tables.numpy())
    out = np.empty((2, 8, 8), np.float32)
    with pytest.raises(ValueError, match="scratch must hold"):
        paged_decode_attention(*args, meta.seq_lens.numpy(), 1.0, out, np.empty(10, np.float32))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] must be in \[1, 32\]"):
        paged_decode_attention(*args, np.array([0, 30], np.int32), 1.0, out,
                               np.empty(400, np.float32))
    with pytest.raises(ValueError, match="Hq % Hkv"):
        paged_decode_attention(query[:, :6].contiguous().numpy(), *args[1:],
                               meta.seq_lens.numpy(), 1.0, out, np.empty(400, np.float32))


def test_backend_decode_matches_torch_reference_and_falls_back_for_prefill() -> None:
    query, cache, meta, _, _ = _decode_batch([3, 20, 33], 16, 8, 4, 8)
    key, value = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    meta.slot_mapping = torch.tensor([2, 16 * int(meta.block_tables[1, 1]) + 3, -1])
    cpu, ref = CpuAttentionBackend(), TorchAttentionBackend()
    assert cpu.name == "cpu"
    caches = {name: cache.clone() for name in ("cpu", "torch")}
    metas = {name: AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                     meta.block_tables, 1, 33, True) for name in caches}
    outs = {}
    for name, backend in (("cpu", cpu), ("torch", ref)):
        backend.reshape_and_cache(key, value, caches[name], metas[name])
        outs[name] = backend.forward(query, caches[name], metas[name], 8 ** -0.5)
    assert torch.equal(caches["cpu"], caches["torch"]), "same slots written, -1 skipped"
    torch.testing.assert_close(outs["cpu"], outs["torch"], atol=1e-6, rtol=1e-5)
    # A step with a prefill chunk runs the torch reference: bit-equal results.
    mixed = AttentionMetadata(torch.tensor([0, 1, 2]), torch.tensor([0, 2, 3], dtype=torch.int32),
                              torch.tensor([3, 20], dtype=torch.int32), meta.block_tables[:2],
                              2, 20, False)
    mixed_ref = AttentionMetadata(*[getattr(mixed, f) for f in (
        "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "max_query_len",
        "max_seq_len", "is_decode_only")])
    assert torch.equal(cpu.forward(query, cache, mixed, 0.3), ref.forward(query, cache,
                                                                            mixed_ref, 0.3))
