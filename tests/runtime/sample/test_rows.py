"""RowAllocator, the row bookkeeping of the sampling and logit-shaping tables: free rows handed
out as a stack (new ones lowest first), freed rows reused, growth by doubling (the owner told
first), errors that change nothing."""
from __future__ import annotations

import numpy as np
import pytest

from nybble.runtime.sample.rows import RowAllocator


def _allocator(capacity: int) -> tuple[RowAllocator, list[tuple[int, int]]]:
    grown: list[tuple[int, int]] = []
    return RowAllocator(capacity, lambda old, new: grown.append((old, new))), grown


def test_add_remove_reuse() -> None:
    rows, grown = _allocator(4)
    assert grown == [(0, 4)] and rows.capacity == 4 and len(rows) == 0 and not rows
    assert rows.add(range(10, 13)) == [0, 1, 2]
    assert len(rows) == 3 and 11 in rows and 13 not in rows
    assert rows.row(12) == 2
    assert rows.rows([12, 10, 12]).tolist() == [2, 0, 2]
    assert rows.rows(np.asarray([11, 10], np.int64).tolist(), 2).dtype == np.int64
    assert rows.remove(11) == 1 and rows.remove(11) is None and rows.remove(99) is None
    assert 11 not in rows and len(rows) == 2
    assert rows.add(range(20, 22)) == [1, 3], "the freed row first, then the lowest free one"
    assert rows.capacity == 4 and grown == [(0, 4)]


def test_find_skips_ids_without_rows() -> None:
    rows, _ = _allocator(2)
    rows.add(range(5, 7))
    positions, found = rows.find([9, 6, 6, 8, 5])
    assert positions.tolist() == [1, 2, 4] and found.tolist() == [1, 1, 0]
    assert positions.dtype == found.dtype == np.int64
    assert rows.find([1, 2]) is None and rows.find([]) is None


def test_growth_doubles_or_fits_the_request() -> None:
    rows, grown = _allocator(2)
    assert rows.add(range(0, 2)) == [0, 1]
    assert rows.add(range(2, 3)) == [2] and grown[-1] == (2, 4) and rows.capacity == 4
    # the new rows go on top of the free stack, lowest first: the old free row 3 comes last
    assert rows.add(range(3, 10)) == [4, 5, 6, 7, 8, 9, 3]
    assert grown[-1] == (4, 10), "room for every row asked when doubling is not enough"
    assert [rows.row(s) for s in range(3)] == [0, 1, 2], "rows kept across growth"


def test_growth_from_zero() -> None:
    rows, grown = _allocator(0)
    assert rows.capacity == 0 and grown == [(0, 0)]
    assert rows.add(range(7, 10)) == [0, 1, 2] and rows.capacity == 3


def test_errors_change_nothing() -> None:
    rows, grown = _allocator(2)
    rows.add(range(0, 2))
    with pytest.raises(ValueError, match="sequence ids 1..2 must be new"):
        rows.add(range(1, 3))
    assert len(rows) == 2 and 2 not in rows and rows.capacity == 2 and grown == [(0, 2)]
    with pytest.raises(KeyError):
        rows.row(5)
    with pytest.raises(KeyError):
        rows.rows([0, 5])
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        RowAllocator(-1, lambda old, new: None)


def test_owner_grows_before_rows_are_handed_out() -> None:
    """The owner's columns have the new rows when ``add`` returns them."""
    columns: list[int] = []
    rows = RowAllocator(1, lambda old, new: columns.extend([0] * (new - old)))
    for seq_id in range(6):
        (row,) = rows.add(range(seq_id, seq_id + 1))
        columns[row] = seq_id + 100
    assert len(columns) == rows.capacity == 8
    assert [columns[rows.row(s)] for s in range(6)] == list(range(100, 106))
