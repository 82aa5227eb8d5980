"""RowAllocator: the row bookkeeping of the model runner's per-sequence tables.

A per-sequence table (:class:`~nybble.runtime.sample.sampling_table.SamplingTable`,
:class:`~nybble.runtime.sample.logit_shaping.LogitShaping`) keeps its state in columns of
``capacity`` rows and addresses them by scheduler sequence id. The allocator maps each id to a
row from a stack of free rows (the last one freed is handed out first; new rows go on top,
lowest first) and grows the capacity when too few are free; the table grows its columns when
told (``on_grow``). A step gathers its rows by index, so
nothing is rebuilt from Python lists per step.

NOTE: each table keeps its own row space (one allocator each) instead of one row index per
request shared by both (vLLM's one persistent input batch). The sampling table has a row for
every admitted sequence (waiting ones included, so more than ``max_num_seqs``), a few scalars
each; the shaping table has rows only for the sequences that shape their logits, and three
``[rows, vocab]`` tensors (bias, prompt mask, output-token counts: about 9 bytes per token of
the vocabulary per row, 1.2 MB at a 128k vocabulary). Indexed by the sampling row, those
tensors would need as many rows as the highest sampling row in use by a shaping sequence: a
few shaping requests behind many plain ones would cost hundreds of MB instead of a few.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np


class RowAllocator:
    """Rows ``[0, capacity)`` handed out to sequence ids.

    Args:
        capacity: initial rows (``>= 0``); ``on_grow(0, capacity)`` is called for them.
        on_grow: ``on_grow(old, new)`` grows the owner's columns from ``old`` to ``new``
            rows; called before the new rows are handed out.

    Raises:
        ValueError: a negative ``capacity``.
    """

    def __init__(self, capacity: int, on_grow: Callable[[int, int], None]) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._row: dict[int, int] = {}     # seq id -> row
        self._free: list[int] = []         # a stack: pop() hands out the top
        self._capacity = 0
        self._on_grow = on_grow
        self._grow(capacity)

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._row)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row

    @property
    def capacity(self) -> int:
        """Rows allocated (in use or free)."""
        return self._capacity

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        self._on_grow(old, capacity)
        self._free += range(capacity - 1, old - 1, -1)
        self._capacity = capacity

    def add(self, seq_ids: range) -> list[int]:
        """Give each of ``seq_ids`` a row, growing to ``max(2 * capacity, in use + new)`` rows
        when too few are free.

        Returns:
            The rows, in the order of ``seq_ids``.

        Raises:
            ValueError: an id already has a row (nothing is added then).
        """
        if any(s in self._row for s in seq_ids):
            raise ValueError(f"sequence ids {seq_ids.start}..{seq_ids.stop - 1} must be new")
        n = len(seq_ids)
        if len(self._free) < n:
            self._grow(max(2 * self._capacity, len(self._row) + n))
        rows = [self._free.pop() for _ in range(n)]
        self._row.update(zip(seq_ids, rows))
        return rows

    def remove(self, seq_id: int) -> int | None:
        """Free the row of ``seq_id`` and return it (its owner clears what it must), or
        ``None`` when the id has no row."""
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._free.append(row)
        return row

    def row(self, seq_id: int) -> int:
        """The row of ``seq_id``.

        Raises:
            KeyError: the id has no row.
        """
        return self._row[seq_id]

    def rows(self, seq_ids: Iterable[int], count: int = -1) -> np.ndarray:
        """``int64`` rows of ``seq_ids`` in order (``count``: their number, when known).

        Raises:
            KeyError: an id without a row.
        """
        return np.fromiter(map(self._row.__getitem__, seq_ids), np.int64, count)

    def find(self, seq_ids: Iterable[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions, rows)``: the positions in ``seq_ids`` of the ids that have a row
        (``int64``, increasing) and their rows; ``None`` when none has."""
        get = self._row.get
        found = [(i, r) for i, r in enumerate(map(get, seq_ids)) if r is not None]
        if not found:
            return None
        pairs = np.array(found, dtype=np.int64)
        return pairs[:, 0], pairs[:, 1]
