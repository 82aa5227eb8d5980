"""Benchmark: Triton paged attention (split-KV decode; varlen prefill).

GPU: decode for batch {1, 32, 128} x context {1k, 8k, 32k} tokens with a Llama-2-7B/Llama-3-8B
style head layout (32 query heads, 8 KV heads, head_dim 128, fp16, block size 16, shuffled
block tables), timed with ``triton.testing.do_bench`` (CUDA events, median after warm-up).
Reports the effective KV-read bandwidth against a measured device copy bandwidth; then a single
long-sequence prefill (TFLOP/s, causal FLOPs). A correctness spot check against the torch
reference runs on the smallest decode shape. Without CUDA it runs a tiny configuration under
the Triton interpreter (a smoke test of the script, not a measurement).

Usage: ``python benchmarks/kernels_attention.py``; writes
``benchmarks/results/kernels_attention.json`` and ``$OUT/kernels_attention.json`` if ``$OUT`` is set.
"""
from __future__ import annotations

import os
import sys
from functools import partial

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels_quant_gemm import bench_ms, copy_bandwidth_gbs

from nybble.bench.report import print_table, write_json
from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.reference.attention import paged_attention
from nybble.kernels.triton.paged_decode import paged_decode_attention
from nybble.kernels.triton.paged_prefill import paged_prefill_attention


def make_case(batch: int, ctx: int, q_len: int, hq: int, hkv: int, d: int, block_size: int,
              device: torch.device):
    """``batch`` sequences of ``ctx`` tokens, the last ``q_len`` of each new; shuffled blocks."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    kv_cache = torch.empty(2, num_blocks, block_size, hkv, d, dtype=torch.float16,
                           device=device).normal_()
    query = torch.randn(batch * q_len, hq, d, dtype=torch.float16, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device=device),  # unused
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32,
                                     device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=q_len, max_seq_len=ctx, is_decode_only=q_len == 1)
    return query, kv_cache, meta


def spot_check(hq: int, hkv: int, d: int, block_size: int, device: torch.device) -> float:
    """Relative max error of the decode kernel vs the torch reference (fp32 math)."""
    query, kv_cache, meta = make_case(2, 300, 1, hq, hkv, d, block_size, device)
    out = paged_decode_attention(query, kv_cache, meta, d ** -0.5)
    ref = paged_attention(query.float(), kv_cache.float(), meta, d ** -0.5)
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    device = torch.device("cuda" if CUDA else "cpu")
    if CUDA:
        hq, hkv, d, bs = 32, 8, 128, 16
        batches, contexts, prefill_lens = [1, 32, 128], [1024, 8192, 32768], [1024, 4096]
        device_name = torch.cuda.get_device_name()
    else:
        hq, hkv, d, bs = 4, 2, 16, 16
        batches, contexts, prefill_lens = [1, 2], [40], [33]
        device_name = "cpu (TRITON_INTERPRET)"
    copy_gbs = copy_bandwidth_gbs(device)
    err = spot_check(hq, hkv, d, bs, device)
    rows = []
    for ctx in contexts:
        for batch in batches:
            query, kv_cache, meta = make_case(batch, ctx, 1, hq, hkv, d, bs, device)
            ms = bench_ms(partial(paged_decode_attention, query, kv_cache, meta, d ** -0.5))
            kv_bytes = 2 * batch * ctx * hkv * d * kv_cache.element_size()
            gbs = kv_bytes / (ms * 1e-3) / 1e9
            rows.append({"batch": batch, "context": ctx, "ms": ms, "kv_GB/s": gbs,
                         "pct_copy_bw": 100 * gbs / copy_gbs, "copy_GB/s": copy_gbs})
            del query, kv_cache, meta
    print_table(rows, title=f"paged decode attention (Hq {hq}, Hkv {hkv}, D {d}, fp16, "
                            f"BS {bs}) on {device_name}; spot-check rel err {err:.2e}")
    prefill_rows = []
    for n in prefill_lens:
        query, kv_cache, meta = make_case(1, n, n, hq, hkv, d, bs, device)
        ms = bench_ms(partial(paged_prefill_attention, query, kv_cache, meta, d ** -0.5))
        flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV over the causal half
        prefill_rows.append({"batch": 1, "tokens": n, "ms": ms,
                             "TFLOP/s": flops / (ms * 1e-3) / 1e12})
    print_table(prefill_rows, title=f"paged varlen prefill attention on {device_name}")
    payload = {"benchmark": "kernels_attention", "device": device_name,
               "heads": {"q": hq, "kv": hkv, "head_dim": d, "block_size": bs},
               "spot_check_rel_err": err, "decode": rows, "prefill": prefill_rows}
    write_json(os.path.join(HERE, "results", "kernels_attention.json"), payload)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "kernels_attention.json"), payload)


if __name__ == "__main__":
    main()
