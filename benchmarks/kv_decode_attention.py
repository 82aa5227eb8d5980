"""CPU decode attention on a one-byte KV cache: keys cached rotated against keys cached before
RoPE (rotated as the Cython kernel reads them), and the float32 cache (docs/kv-cache.md).

One decode step's attention for ``--batch`` sequences of ``--seq-len`` cached tokens (8 query /
4 KV heads of 64 by default: a small GQA model's layer) through
:class:`nybble.kernels.cpu.backend.CpuAttentionBackend`, one torch thread. Each variant is
timed in alternating rounds (median of ``--rounds``, each the median of ``--repeat`` calls),
so that a load change on a shared machine hits every variant alike. Prints a table, writes
``benchmarks/results/kv_decode_attention.json``.

Run: ``OMP_NUM_THREADS=1 python benchmarks/kv_decode_attention.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]   # benchmarks/ and the repo root, as a script

from _report import print_table, write_json  # noqa: E402
from nybble.kernels.cpu.backend import CpuAttentionBackend  # noqa: E402
from nybble.kernels.interface import AttentionMetadata  # noqa: E402
from nybble.kernels.kv_quant import RotaryKeys, quantize_kv  # noqa: E402


def _batch(batch: int, seq_len: int, hq: int, hkv: int, d: int, block_size: int = 16):
    """A decode batch whose sequences own distinct, shuffled blocks; the float32 cache."""
    g = torch.Generator().manual_seed(0)
    blocks = -(-seq_len // block_size)
    perm = torch.randperm(batch * blocks, generator=g)
    tables = perm.view(batch, blocks).to(torch.int32)
    cache = torch.randn(2, batch * blocks, block_size, hkv, d, generator=g)
    slots = tables[:, (seq_len - 1) // block_size].long() * block_size + (seq_len - 1) % block_size
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(batch + 1,
                                                                              dtype=torch.int32),
                             seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
                             block_tables=tables, max_query_len=1, max_seq_len=seq_len,
                             is_decode_only=True)
    query = torch.randn(batch, hq, d, generator=g)
    return query, cache, meta


def _one_byte(cache: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    hkv, d = cache.shape[3], cache.shape[4]
    return torch.stack([quantize_kv(cache[i].reshape(-1, hkv, d), scale[i], dtype)
                        .view(cache[i].shape) for i in range(2)])


def _time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heads", type=int, nargs=3, default=[8, 4, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(_HERE, "results", "kv_decode_attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    hq, hkv, d = args.heads
    query, cache, meta = _batch(args.batch, args.seq_len, hq, hkv, d)
    scale = torch.full((2, hkv), 4.0 / 127)
    table = torch.randn(args.seq_len, 2, d)
    keys = RotaryKeys(torch.randn(hkv, d) * 0.1, table)
    backend = CpuAttentionBackend()
    variants = {"float32": (cache, None, None)}
    for name, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        one = _one_byte(cache, dtype, scale)
        variants[f"{name}, keys rotated"] = (one, scale, None)
        variants[f"{name}, keys before RoPE"] = (one, scale, keys)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (kv, kv_scale, rotary) in variants.items():
            times[name].append(_time(lambda: backend.forward(
                query, kv, meta, d ** -0.5, kv_scale, rotary_keys=rotary), args.repeat))
    rows = [{"cache": name, "ms": round(statistics.median(t) * 1e3, 3),
             "min_ms": round(min(t) * 1e3, 3)} for name, t in times.items()]
    print_table(rows, f"CPU decode attention, {args.batch} sequences x {args.seq_len} tokens, "
                      f"{hq} query / {hkv} KV heads of {d}, load {os.getloadavg()[0]:.2f}")
    write_json(args.out, {"batch": args.batch, "seq_len": args.seq_len, "heads": args.heads,
                          "rounds": args.rounds, "repeat": args.repeat,
                          "load_avg_1m": os.getloadavg()[0], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
