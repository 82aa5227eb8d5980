"""Benchmark: fused INT4 g128 dequant-GEMM (GPTQ, AWQ) vs a torch fp16 matmul.

GPU: M in {1, 4, 16, 64, 256} at (K, N) = 4096x4096 and 4096x11008, timed with
``triton.testing.do_bench`` (CUDA events, median over many runs after warm-up). Reports
TFLOP/s and the effective weight bandwidth (bytes of the packed weight + scales + zeros per
second) next to a measured device-to-device copy bandwidth. Without CUDA it runs a tiny
configuration under the Triton interpreter (a smoke test of this script, not a measurement).

Usage: ``python benchmarks/kernels_quant_gemm.py``; writes
``benchmarks/results/kernels_quant_gemm.json`` and ``$OUT/kernels_quant_gemm.json`` if ``$OUT`` is set.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nybble.bench.report import print_table, write_json
from nybble.kernels.triton.quant_gemm import awq_gemm, gptq_gemm


def bench_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call: CUDA events via do_bench on GPU, wall clock on CPU."""
    if CUDA:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second), GB/s."""
    numel = (1 << 28) if CUDA else (1 << 20)  # 512 MiB fp16 on GPU
    src = torch.empty(numel, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def make_weights(k: int, n: int, group: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random INT4 tensors in both layouts (packing is irrelevant to speed, shapes are not)."""
    g = k // group
    def rand_words(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device)

    scales = (torch.rand(g, n, device=device) * 0.01 + 0.001).half()
    return {"gptq_qweight": rand_words(k // 8, n), "gptq_qzeros": rand_words(g, n // 8),
            "awq_qweight": rand_words(k, n // 8), "awq_qzeros": rand_words(g, n // 8),
            "scales": scales}


def _cases(x: torch.Tensor, w: dict[str, torch.Tensor], w16: torch.Tensor, group: int,
           qbytes: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, weight bytes it must read) for one activation ``x``."""
    k, n = w16.shape
    return {
        "torch_fp16": (lambda: x @ w16, k * n * 2),
        "gptq_int4": (lambda: gptq_gemm(x, w["gptq_qweight"], w["gptq_qzeros"], w["scales"],
                                        None, 4, group, 1, True, None), qbytes),
        "awq_int4": (lambda: awq_gemm(x, w["awq_qweight"], w["awq_qzeros"], w["scales"], group,
                                      None), qbytes),
    }


def run(shapes: list[tuple[int, int]], ms_list: list[int], group: int) -> list[dict]:
    device = torch.device("cuda" if CUDA else "cpu")
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for k, n in shapes:
        w = make_weights(k, n, group, device)
        w16 = torch.randn(k, n, device=device).half() * 0.02
        qbytes = (w["gptq_qweight"].numel() + w["gptq_qzeros"].numel()) * 4 \
            + w["scales"].numel() * 2
        for m in ms_list:
            x = torch.randn(m, k, device=device).half()
            cases = _cases(x, w, w16, group, qbytes)
            base_ms = None
            for name, (fn, weight_bytes) in cases.items():
                ms = bench_ms(fn)
                base_ms = ms if name == "torch_fp16" else base_ms
                weight_gbs = weight_bytes / (ms * 1e-3) / 1e9
                rows.append({"K": k, "N": n, "M": m, "kernel": name, "ms": ms,
                             "TFLOP/s": 2 * m * n * k / (ms * 1e-3) / 1e12,
                             "weight_GB/s": weight_gbs,
                             "pct_copy_bw": 100 * weight_gbs / copy_gbs,
                             "speedup_vs_fp16": base_ms / ms})
    for r in rows:
        r["copy_GB/s"] = copy_gbs
    return rows


def main() -> None:
    if CUDA:
        shapes, ms_list, group = [(4096, 4096), (4096, 11008)], [1, 4, 16, 64, 256], 128
        device_name = torch.cuda.get_device_name()
    else:  # interpreter smoke configuration
        shapes, ms_list, group, device_name = [(128, 64)], [1, 17], 64, "cpu (TRITON_INTERPRET)"
    rows = run(shapes, ms_list, group)
    print_table(rows, title=f"INT4 g{group} dequant-GEMM vs fp16 matmul on {device_name}")
    payload = {"benchmark": "kernels_quant_gemm", "device": device_name, "group_size": group,
               "rows": rows}
    write_json(os.path.join(HERE, "results", "kernels_quant_gemm.json"), payload)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "kernels_quant_gemm.json"), payload)


if __name__ == "__main__":
    main()
