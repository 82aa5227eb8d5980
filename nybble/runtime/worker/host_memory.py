"""Keep freed host memory in the process, so a CPU step's large temporaries do not page-fault.

glibc's ``malloc`` serves blocks over its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and unmaps them on ``free``; the next allocation of that size touches new pages, and every
4 KiB page faults (a few microseconds each on a VM). A CPU decode step allocates the same large
temporaries every layer of every step (the KV gathered for attention: ``2 * B * S * Hkv * D``
floats, 39 MB at 32 sequences x 200 tokens of a 768-wide model; prefill activations), so on
this path an unlucky size costs ~40 ms of page faults per layer instead of ~6 ms of copying
(``benchmarks/step_breakdown.py``). Turning off mmap for ``malloc`` and never trimming the heap
keeps those pages mapped and reused, as jemalloc/tcmalloc do for PyTorch CPU inference.

The process's peak heap is not returned to the OS afterwards: the engine core is a
long-running process whose working set repeats every step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def _glibc() -> ctypes.CDLL | None:
    """The C library on Linux, or None (another OS, or it cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Make glibc ``malloc`` keep freed blocks (``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD`` =
    1 TiB); once per process. Returns whether it is in effect (False off Linux/glibc)."""
    global _applied
    if _applied:
        return True
    mallopt = getattr(_glibc(), "mallopt", None)   # musl has no mallopt
    if mallopt is None:
        return False
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 40))
    if not _applied:
        logger.debug("mallopt refused; large CPU temporaries may page-fault every step")
    return _applied


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``), e.g. after the
    weights were copied elsewhere. Returns whether anything was released (False off glibc)."""
    malloc_trim = getattr(_glibc(), "malloc_trim", None)
    return bool(malloc_trim(0)) if malloc_trim is not None else False
