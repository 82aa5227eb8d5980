"""nybble.kernels.cpu.huge_pages: copies equal to their sources, laid out as documented (the
mapping on a 2 MiB boundary, every array on a 64-byte one), and backed by huge pages where the
kernel's transparent-huge-page mode allows it."""
from __future__ import annotations

import numpy as np
import pytest

from nybble.kernels.cpu.huge_pages import HUGE_PAGE, huge_page_bytes, huge_page_copy, thp_mode


def test_copies_are_equal_aligned_and_writable() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, 1000, dtype=np.uint8),
              rng.standard_normal((33, 7)).astype(np.float32),
              rng.integers(0, 65535, (3, 5), dtype=np.uint16),
              np.zeros(0, dtype=np.int8),
              rng.standard_normal(5)[::2]]                 # not contiguous: copied contiguous
    copies = huge_page_copy(arrays)
    assert len(copies) == len(arrays)
    for a, c in zip(arrays, copies):
        assert c.dtype == a.dtype and c.shape == a.shape and c.flags.c_contiguous
        assert np.array_equal(a, c) and not np.shares_memory(a, c)
    assert copies[0].ctypes.data % HUGE_PAGE == 0
    assert all(c.ctypes.data % 64 == 0 for c in copies)
    laid = [c for c in copies if c.nbytes]           # an empty array's address means nothing
    assert all(a.ctypes.data + a.nbytes <= b.ctypes.data for a, b in zip(laid, laid[1:]))
    copies[1][0, 0] = 7.0
    assert copies[1][0, 0] == 7.0 and arrays[1][0, 0] != 7.0


def test_no_arrays_no_mapping() -> None:
    assert huge_page_copy([]) == []
    assert huge_page_bytes([]) == 0


def test_thp_mode_is_one_of_the_kernel_settings() -> None:
    assert thp_mode() in ("always", "madvise", "never")


@pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off here")
def test_large_copy_is_backed_by_huge_pages() -> None:
    big = np.arange(3 * HUGE_PAGE // 4, dtype=np.float32)       # 6 MiB
    copy = huge_page_copy([big])[0]
    assert np.array_equal(copy, big)
    # at least the two whole 2 MiB pages inside the 6 MiB (the kernel may lack a free one at
    # the moment it faults; with madvise it compacts to find one)
    assert huge_page_bytes([copy]) >= 2 * HUGE_PAGE
