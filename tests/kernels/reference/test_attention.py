"""The torch reference (the CPU path and the Triton tests' oracle) against a naive float64
per-sequence, per-head softmax attention written from the definition."""
from __future__ import annotations

import math

import pytest
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.reference.attention import paged_attention, reshape_and_cache


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int,
           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [q_len, Hq, D]; k, v: [S, Hkv, D] (the whole sequence); causal, float64; a query
    at ``pos`` sees keys ``pos - window < j <= pos`` with a window; scores capped to
    ``c * tanh(s / c)`` with a softcap."""
    seq_len, hkv, _ = k.shape
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for t in range(q_len):
        pos = seq_len - q_len + t
        first = max(0, pos - window + 1) if window else 0
        for h in range(q.shape[1]):
            s = [float(q[t, h] @ k[j, h // group]) / math.sqrt(q.shape[2])
                 for j in range(first, pos + 1)]
            if softcap:
                s = [softcap * math.tanh(x / softcap) for x in s]
            m = max(s)
            w = torch.tensor([math.exp(x - m) for x in s], dtype=torch.float64)
            out[t, h] = (w[:, None] * v[first: pos + 1, h // group]).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("block_size,hq,hkv", [(16, 4, 4), (32, 8, 2), (16, 8, 1)])
def test_mixed_prefill_decode_batch(block_size: int, hq: int, hkv: int) -> None:
    _check_mixed_batch(block_size, hq, hkv, None, None)


@pytest.mark.parametrize("window,softcap", [(8, None), (5, 2.0), (None, 1.5), (1, None),
                                            (64, None)])
def test_sliding_window_and_softcap(window: int | None, softcap: float | None) -> None:
    """Windows shorter than the chunks, than the cached prefix, of one token and longer than
    every sequence; soft-capping alone and with a window."""
    _check_mixed_batch(16, 8, 2, window, softcap)


def _check_mixed_batch(block_size: int, hq: int, hkv: int, window: int | None,
                       softcap: float | None) -> None:
    torch.manual_seed(0)
    d = 8
    # (cached tokens, new tokens): plain prefill, chunked prefill, decodes, odd lengths
    plan = [(0, 17), (15, 1), (33, 5), (40, 1), (0, 1), (16, 16)]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks, block_size, hkv, d, dtype=torch.float64)
    perm = torch.randperm(num_blocks).tolist()
    tables, ks, vs, new_q = [], [], [], []
    for cached, new in plan:
        n = cached + new
        nb = (n + block_size - 1) // block_size
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k, v = torch.randn(n, hkv, d, dtype=torch.float64), torch.randn(n, hkv, d,
                                                                        dtype=torch.float64)
        slots = torch.tensor([table[j // block_size] * block_size + j % block_size
                              for j in range(n)])
        reshape_and_cache(k, v, cache, slots)  # the whole sequence is in the cache
        ks.append(k)
        vs.append(v)
        new_q.append(torch.randn(new, hq, d, dtype=torch.float64))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + [new for _, new in plan]).cumsum(0).int(),
        seq_lens=torch.tensor([c + n for c, n in plan], dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        max_query_len=max(n for _, n in plan), max_seq_len=max(c + n for c, n in plan),
        is_decode_only=False)
    out = paged_attention(torch.cat(new_q), cache, meta, d ** -0.5, window=window,
                          softcap=softcap)
    want = torch.cat([_naive(q, k, v, q.shape[0], window, softcap)
                      for q, k, v in zip(new_q, ks, vs)])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
