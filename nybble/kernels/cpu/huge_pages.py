"""Copy arrays into one anonymous mapping backed by 2 MiB transparent huge pages.

Why: a one-row decode step streams every weight byte once (90 MB for SmolLM2-135M Q4_0), and
the integer-dot kernel reads each tile as several streams plus the next tile's prefetches and
the scale rows, a few dozen 4 KiB pages at once. On 4 KiB pages those accesses miss the TLB all
the time and a software prefetch that misses the TLB may be dropped; on 2 MiB pages a whole
projection sits in one or two TLB entries. Measured on this project's 2-core AMD EPYC (one
thread, the 120 integer-dot GEMVs of SmolLM2's 30 layers, alternating runs): 3.8-4.1 ms on
4 KiB pages, 2.4-2.9 ms on huge pages (benchmarks/README.md).

Linux only: ``madvise(MADV_HUGEPAGE)`` on a 2 MiB-aligned anonymous mapping, so the pages are
huge when they are first touched (the copy) wherever the kernel's transparent-huge-page mode is
``always`` or ``madvise``; with ``never`` (or on another OS) the copy is plain memory and
nothing changes but the addresses. Torch-free.
"""
from __future__ import annotations

import mmap
import sys
from collections.abc import Sequence

import numpy as np

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 transparent huge page."""

_THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode: ``always``, ``madvise`` or ``never``
    (``never`` off Linux or when the setting cannot be read)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "never"
    try:
        with open(_THP_FILE, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


def huge_page_copy(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Copies of ``arrays`` laid out one after another (each at a 64-byte boundary) in one
    fresh anonymous mapping that starts on a 2 MiB boundary and is advised ``MADV_HUGEPAGE``.

    Args:
        arrays: any dtypes and shapes (copied C-contiguous).

    Returns:
        One writable C-contiguous array per input, equal to it, of the same dtype and shape;
        each keeps the mapping alive (its ``base``). An empty list for no arrays.

    Raises:
        OSError: the mapping could not be made (out of memory).
    """
    if not arrays:
        return []
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 64) * 64
    size = -(-total // HUGE_PAGE) * HUGE_PAGE
    # one extra huge page so the arrays can start on a 2 MiB boundary (mmap aligns to 4 KiB)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, start, size)   # before the first touch
    out = []
    for a, off in zip(arrays, offsets):
        view = whole[start + off:start + off + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        out.append(view)
    return out


def huge_page_bytes(arrays: Sequence[np.ndarray]) -> int:
    """Bytes of the mapping(s) holding ``arrays`` that the kernel backs with huge pages now
    (``AnonHugePages`` of ``/proc/self/smaps``); 0 off Linux."""
    if not sys.platform.startswith("linux") or not arrays:
        return 0
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]
    total, hit = 0, False
    try:
        with open("/proc/self/smaps", encoding="ascii") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    hit = any(lo < e and s < hi for s, e in spans)
                elif hit and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
