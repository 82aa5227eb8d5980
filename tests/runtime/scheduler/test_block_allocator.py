"""BlockAllocator: unit tests and a hypothesis state machine (through the Python API)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from nybble.runtime.scheduler.block_allocator import BlockAllocator


def test_fresh_pool_hands_out_distinct_blocks_then_none() -> None:
    alloc = BlockAllocator(4, 16)
    got = [alloc.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3]
    assert alloc.num_free_blocks == 0
    assert alloc.allocate() is None            # exhaustion is a value, not an exception
    assert (alloc.num_blocks, alloc.block_size) == (4, 16)


def test_free_returns_block_and_is_reused() -> None:
    alloc = BlockAllocator(2, 1)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.free(a)
    assert alloc.num_free_blocks == 1 and alloc.ref_count(a) == 0
    assert alloc.allocate() == a
    assert alloc.ref_count(b) == 1


def test_fork_shares_blocks_until_last_owner_frees() -> None:
    alloc = BlockAllocator(8, 4)
    table = [alloc.allocate() for _ in range(3)]
    alloc.fork(table)
    alloc.fork(table)
    assert [alloc.ref_count(b) for b in table] == [3, 3, 3]
    for _ in range(2):
        for b in table:
            alloc.free(b)
    assert alloc.num_free_blocks == 5
    for b in table:
        alloc.free(b)
    assert alloc.num_free_blocks == 8


def test_double_free_raises_naming_block() -> None:
    alloc = BlockAllocator(3, 4)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(RuntimeError, match=rf"KV block {b} .*double free.*bug"):
        alloc.free(b)
    assert alloc.num_free_blocks == 3          # the failed free changed nothing


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_out_of_range_ids_raise(bad: int) -> None:
    alloc = BlockAllocator(3, 4)
    with pytest.raises(RuntimeError, match=rf"KV block {bad} is outside the pool"):
        alloc.free(bad)
    with pytest.raises(RuntimeError, match=rf"KV block {bad}"):
        alloc.incref(bad)
    with pytest.raises(ValueError, match="`block_id` must be in"):
        alloc.ref_count(bad)


def test_incref_and_cow_of_free_block_raise() -> None:
    alloc = BlockAllocator(3, 4)
    with pytest.raises(RuntimeError, match="KV block 1 was incref'd while it is free"):
        alloc.incref(1)
    with pytest.raises(RuntimeError, match="KV block 2 was written"):
        alloc.copy_on_write(2)
    with pytest.raises(RuntimeError, match="KV block 0"):
        alloc.fork([0])


def test_copy_on_write_moves_one_reference() -> None:
    alloc = BlockAllocator(2, 4)
    b = alloc.allocate()
    assert alloc.copy_on_write(b) == b            # sole owner writes in place
    alloc.incref(b)
    d = alloc.copy_on_write(b)
    assert d not in (None, b)
    assert alloc.ref_count(b) == 1 and alloc.ref_count(d) == 1
    alloc.incref(b)
    assert alloc.copy_on_write(b) is None         # pool empty: capacity, not an error
    assert alloc.ref_count(b) == 2


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 4},
                                    {"num_blocks": 4, "block_size": 0}])
def test_bad_sizes_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        BlockAllocator(**kwargs)


def test_debug_state_lists_free_stack() -> None:
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate()
    state = alloc.debug_state()
    assert state["ref_counts"].tolist() == [1 if i == a else 0 for i in range(4)]
    assert sorted(state["free_list"].tolist()) == [i for i in range(4) if i != a]


class AllocatorMachine(RuleBasedStateMachine):
    """Owners hold block tables; the model is a list of tables (a table = list of ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(12, 4)
        self.owners: list[list[int]] = []

    @rule()
    def new_owner(self) -> None:
        self.owners.append([])

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def allocate(self, i: int) -> None:
        free_before = self.alloc.num_free_blocks
        b = self.alloc.allocate()
        if free_before == 0:
            assert b is None
            return
        assert b is not None and all(b not in t for t in self.owners), "block handed out twice"
        self.owners[i % len(self.owners)].append(b)

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        table = list(self.owners[i % len(self.owners)])
        self.alloc.fork(table)
        self.owners.append(table)

    @precondition(lambda self: any(self.owners))
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def copy_on_write(self, i: int, j: int) -> None:
        tables = [t for t in self.owners if t]
        table = tables[i % len(tables)]
        k = j % len(table)
        shared = self.alloc.ref_count(table[k]) > 1
        out = self.alloc.copy_on_write(table[k])
        if out is None:
            assert shared and self.alloc.num_free_blocks == 0
        elif shared:
            assert out != table[k] and self.alloc.ref_count(out) == 1
            table[k] = out
        else:
            assert out == table[k]

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def release_owner(self, i: int) -> None:
        for b in reversed(self.owners.pop(i % len(self.owners))):
            self.alloc.free(b)

    @invariant()
    def ref_counts_match_owners(self) -> None:
        state = self.alloc.debug_state()
        held = Counter(b for t in self.owners for b in t)
        assert state["ref_counts"].tolist() == [held.get(b, 0) for b in range(12)]
        free = state["free_list"].tolist()
        assert len(free) == len(set(free)) == self.alloc.num_free_blocks
        assert set(free) == {b for b in range(12) if held.get(b, 0) == 0}

    def teardown(self) -> None:
        while self.owners:
            self.release_owner(0)
        assert self.alloc.num_free_blocks == 12
        assert not np.any(self.alloc.debug_state()["ref_counts"])


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                              deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
