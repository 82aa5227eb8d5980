"""The thread count of nybble's C kernels (the quantized GEMMs and the fused decode step).

Each compiled module has its own pool (``pool.h``): the caller plus ``threads - 1`` workers
that claim chunks of output columns (and, in the fused step, sequences' attention) from one
counter, so a worker that gets no core holds nothing up. Torch-free.
"""
from __future__ import annotations

import importlib

_MODULES = ("nybble.kernels.cpu.qgemm", "nybble.kernels.cpu.wo_gemm", "nybble.kernels.cpu.decoder")


def set_kernel_threads(threads: int) -> dict[str, int]:
    """Set every built kernel module's pool to ``threads`` threads.

    Args:
        threads: >= 1 (the calling thread counts as one).

    Returns:
        ``{module: threads in use}`` for the modules that are built (a source checkout
        without ``build_ext`` has none).

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    applied = {}
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        applied[name] = module.set_threads(threads)
    return applied
