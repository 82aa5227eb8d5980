"""Memory read bandwidth of one core (or N threads), measured the way a batch-1 decode step
reads its weights.

Two probes over one array far larger than the caches (default 512 MiB of float32), each timed
``repeats`` times after one untimed pass:

* ``gemv``: ``torch.mv(A, x)`` on ``threads`` torch threads, ``A`` float32 ``[rows, 4096]``: a
  dense decode step's access pattern (every weight read once, a few flops each).
* ``numpy_sum``: ``numpy.sum`` over the same bytes as a flat float32 array (one thread; numpy's
  reduction is single-threaded).

Bandwidth = bytes read / seconds, in GB/s (1e9 bytes). Both the best and the median of the
repeats are returned. The weight-bandwidth limit uses the best GEMV: on a shared machine other
processes only ever slow a call down, so the fastest call is the nearest to what the core can
do. numpy's sum is kept for comparison only (it measured 8-15 GB/s against the GEMV's 21 on
the dev box: partly compute-bound).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

_COLS = 4096


def _time_calls(fn: Any, repeats: int) -> list[float]:
    fn()   # first touch / warm-up, untimed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def read_bandwidth(size_bytes: int = 512 << 20, repeats: int = 7,
                   threads: int = 1) -> dict[str, Any]:
    """Measure the read bandwidth of ``threads`` torch threads with a float32 GEMV, and of one
    thread with a numpy sum.

    Args:
        size_bytes: bytes of the array read per call (rounded down to whole 4096-float rows).
        repeats: timed calls per probe (``>= 1``).
        threads: torch threads of the GEMV (``>= 1``); the caller's count is restored after.

    Returns:
        ``{"bytes": n, "repeats": r, "threads": t, "gemv_gb_s": median,
        "gemv_best_gb_s": best, "numpy_sum_gb_s": median, "numpy_sum_best_gb_s": best}``.

    Raises:
        ValueError: ``repeats < 1``, ``threads < 1`` or ``size_bytes`` below one row (16 KiB).
    """
    import numpy as np
    import torch

    if repeats < 1 or threads < 1:
        raise ValueError(f"repeats and threads must be >= 1, got {repeats} and {threads}")
    rows = size_bytes // (4 * _COLS)
    if rows < 1:
        raise ValueError(f"size_bytes must be >= {4 * _COLS}, got {size_bytes}")
    nbytes = rows * _COLS * 4
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.rand(rows, _COLS, dtype=torch.float32)
        x = torch.rand(_COLS, dtype=torch.float32)
        gemv = _time_calls(lambda: torch.mv(a, x), repeats)
        flat = a.numpy().reshape(-1)
        npsum = _time_calls(lambda: np.sum(flat), repeats)
    finally:
        torch.set_num_threads(prev_threads)
    del a, x
    return {"bytes": nbytes, "repeats": repeats, "threads": threads,
            "gemv_gb_s": nbytes / statistics.median(gemv) / 1e9,
            "gemv_best_gb_s": nbytes / min(gemv) / 1e9,
            "numpy_sum_gb_s": nbytes / statistics.median(npsum) / 1e9,
            "numpy_sum_best_gb_s": nbytes / min(npsum) / 1e9}
