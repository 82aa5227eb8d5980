"""Memory read bandwidth of one core (or N threads), measured the way a batch-1 decode step
reads its weights.

Two probes over one array far larger than the caches (default 512 MiB of float32), each timed
``repeats`` times after one untimed pass:

* ``gemv``: ``torch.mv(A, x)`` on ``threads`` torch threads, ``A`` float32 ``[rows, 4096]``: a
  dense decode step's access pattern (every weight read once, a few flops each).
* ``gemv_huge``: the same GEMV on a copy of ``A`` on 2 MiB transparent huge pages
  (``nybble.kernels.cpu.huge_pages``, where nybble's CPU weights live since 2026-12-07): fewer
  TLB misses, so one core streams faster (on the dev box 20-32 GB/s against 18-21).
* ``stream_huge``: nybble's one-row float32 GEMV (``decoder.dense_linear``: row by row, a
  prefetch 1 KiB ahead) over the same huge-page bytes viewed as rows of 576 floats (of 576,
  1536 and 4096 the width it streams fastest), on ``threads`` kernel threads: the fastest
  streaming loop known here (on the dev box ~31 GB/s on one core where torch's ``mv`` reads
  ~21 on either page size).
* ``numpy_sum``: ``numpy.sum`` over the same bytes as a flat float32 array (one thread; numpy's
  reduction is single-threaded).

Bandwidth = bytes read / seconds, in GB/s (1e9 bytes). Both the best and the median of the
repeats are returned. The weight-bandwidth limit uses the best call of the three GEMVs
(``limit_gb_s``): on a shared machine other processes only ever slow a call down, so the
fastest call is the nearest to what the core can do. numpy's sum is kept for comparison only (it measured 8-15 GB/s against the GEMV's 21 on
the dev box: partly compute-bound).
"""
from __future__ import annotations

import statistics
import time
from typing import Any

_COLS = 4096
_STREAM_COLS = 576


def _time_calls(fn: Any, repeats: int) -> list[float]:
    fn()   # first touch / warm-up, untimed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _stream(a: Any, x: Any, repeats: int, threads: int) -> list[float]:
    """Times of nybble's one-row GEMV over ``a`` on ``threads`` kernel threads ([] when the
    compiled kernels are not built)."""
    import numpy as np

    try:
        from nybble.kernels.cpu import decoder
        from nybble.kernels.cpu.threads import set_kernel_threads
    except ImportError:
        return []
    flat = a.reshape(-1)
    rows = flat.size // _STREAM_COLS
    w = flat[:rows * _STREAM_COLS].reshape(rows, _STREAM_COLS)
    v = np.ascontiguousarray(x[None, :_STREAM_COLS])
    out = np.empty((1, rows), dtype=np.float32)
    set_kernel_threads(threads)
    try:
        return _time_calls(lambda: decoder.dense_linear(v, w, out), repeats)
    finally:
        set_kernel_threads(1)


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
        "gemv_best_gb_s": best, "gemv_huge_gb_s": median, "gemv_huge_best_gb_s": best,
        "stream_huge_gb_s": median, "stream_huge_best_gb_s": best (absent when the compiled
        kernels are not built), "limit_gb_s": the largest best, "numpy_sum_gb_s": median,
        "numpy_sum_best_gb_s": best}``.

    Raises:
        ValueError: ``repeats < 1``, ``threads < 1`` or ``size_bytes`` below one row (16 KiB).
    """
    import numpy as np
    import torch

    from nybble.kernels.cpu.huge_pages import huge_page_copy

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
        huge = torch.from_numpy(huge_page_copy([a.numpy()])[0])
        del a, flat
        gemv_huge = _time_calls(lambda: torch.mv(huge, x), repeats)
        stream = _stream(huge.numpy(), x.numpy(), repeats, threads)
    finally:
        torch.set_num_threads(prev_threads)
    del huge, x
    best = {"gemv_best_gb_s": nbytes / min(gemv) / 1e9,
            "gemv_huge_best_gb_s": nbytes / min(gemv_huge) / 1e9}
    medians = {"gemv_gb_s": nbytes / statistics.median(gemv) / 1e9,
               "gemv_huge_gb_s": nbytes / statistics.median(gemv_huge) / 1e9}
    if stream:
        best["stream_huge_best_gb_s"] = nbytes / min(stream) / 1e9
        medians["stream_huge_gb_s"] = nbytes / statistics.median(stream) / 1e9
    return {"bytes": nbytes, "repeats": repeats, "threads": threads, **medians, **best,
            "limit_gb_s": max(best.values()),
            "numpy_sum_gb_s": nbytes / statistics.median(npsum) / 1e9,
            "numpy_sum_best_gb_s": nbytes / min(npsum) / 1e9}
