"""Plain-Python reference of the KV block allocator and its prefix cache (the tests' oracle).

The same rules as block_allocator.pyx and prefix_cache.pyx, written for reading, and the same
block ids in the same order (a LIFO free stack with block 0 on top, then the least recently
used parked block), so that a scheduler built on it hands out identical block tables:

* a block with ref count r > 0 is in r owners' tables; a block with ref count 0 is on the free
  stack or, when cached, parked in the LRU of the prefix cache -- both count as free;
* a cached block is named by the whole token prefix it ends (the tuple the Cython core's
  chained 64-bit hash stands for), so a hit means "same prefix", with no hashing here.

* sliding windows (vLLM's sliding-window KV manager): with ``reserve_null_block`` block 0 is
  the null block, never handed out, owned (ref count 0) or freed; ``remove_skipped_blocks``
  releases a table's leading blocks out of every window and points them at it.

Capacity is a return value (``None`` / ``False``); a bookkeeping bug raises RuntimeError.
No torch is imported here.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def prefix_key(root: int, prefix: tuple[int, ...]) -> tuple[int, ...]:
    """The name of the block that ends ``prefix`` under the chain root ``root``: the prefix
    itself for the shared root 0, else the prefix behind a ``(-1, root)`` tag (token ids are
    never negative), so two roots never name the same block."""
    return prefix if root == 0 else (-1, root, *prefix)


class ReferencePrefixCache:
    """Full blocks by token prefix, and the LRU of parked (ref count 0) cached blocks.

    Args:
        block_size: tokens per block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.block_of: dict[tuple[int, ...], int] = {}     # prefix -> cached block
        self.prefix_of: dict[int, tuple[int, ...]] = {}    # cached block -> prefix
        self.parked: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.num_evictions = 0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix (owned or parked)."""
        return len(self.prefix_of)

    @property
    def num_evictable_blocks(self) -> int:
        """Parked cached blocks (ref count 0; counted free)."""
        return len(self.parked)

    def match(self, token_ids: Sequence[int], root: int = 0) -> np.ndarray:
        """Block ids of the longest cached chain of full blocks of ``token_ids`` (int32[k])
        under the chain root ``root`` (a LoRA adapter's; 0: the shared one)."""
        bs, tokens, out = self.block_size, tuple(int(t) for t in token_ids), []
        for end in range(bs, len(tokens) + 1, bs):
            block = self.block_of.get(prefix_key(root, tokens[:end]))
            if block is None:
                break
            out.append(block)
        return np.array(out, dtype=np.int32)

    def register(self, block: int, prefix: tuple[int, ...]) -> None:
        """Cache an owned, full, computed ``block`` ending ``prefix``; the first block cached
        under a prefix wins, and a cached block keeps its first prefix."""
        if block not in self.prefix_of and prefix not in self.block_of:
            self.block_of[prefix], self.prefix_of[block] = block, prefix

    def evict(self) -> int | None:
        """Reuse the least recently used parked block (its prefix is dropped); None if none."""
        if not self.parked:
            return None
        block, _ = self.parked.popitem(last=False)
        del self.block_of[self.prefix_of.pop(block)]
        self.num_evictions += 1
        return block


class ReferenceBlockAllocator:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens with ref counts.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: park freed cached blocks instead of stacking them.
        reserve_null_block: block 0 is the null block (sliding windows), out of the pool.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 reserve_null_block: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.null_block = 0 if reserve_null_block else -1
        # top = end: the lowest block first (block 0, or 1 when 0 is the null block)
        self.free_stack = list(range(num_blocks - 1, 0 if reserve_null_block else -1, -1))
        self.prefix_cache = ReferencePrefixCache(block_size) if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free stack plus the parked cached blocks."""
        parked = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return len(self.free_stack) + parked

    def allocate(self) -> int | None:
        """A block with ref count 1: the free stack's top, else the LRU parked block."""
        if self.free_stack:
            block = self.free_stack.pop()
        elif self.prefix_cache is None or (block := self.prefix_cache.evict()) is None:
            return None
        self.ref_counts[block] = 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; at 0 park a cached block (most recent last), stack any other."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"KV block {block} freed at ref count 0 (a bug)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.prefix_cache is not None and block in self.prefix_cache.prefix_of:
                self.prefix_cache.parked[block] = None
            else:
                self.free_stack.append(block)

    def incref(self, block: int) -> None:
        """One more owner of an owned block, or of a parked cached block (a prefix hit)."""
        if self.ref_counts[block] == 0:
            if self.prefix_cache is None or block not in self.prefix_cache.parked:
                raise RuntimeError(f"KV block {block} incref'd while free (a bug)")
            del self.prefix_cache.parked[block]
        self.ref_counts[block] += 1

    def free_blocks(self, table: list[int]) -> None:
        """Free a whole block table, last block first (null entries skipped), and empty it."""
        while table:
            block = table.pop()
            if block != self.null_block:
                self.free(block)

    def fork(self, table: list[int]) -> None:
        """One more owner of every block of ``table`` (null entries skipped)."""
        for block in table:
            if block != self.null_block:
                self.incref(block)

    def remove_skipped_blocks(self, table: list[int], num_skipped: int) -> int:
        """Release the first ``num_skipped`` entries of ``table`` that are not yet the null
        block, last first, and point them at it (vLLM's
        ``SlidingWindowManager.remove_skipped_blocks``); the blocks released."""
        released, k = 0, min(num_skipped, len(table)) - 1
        while k >= 0 and table[k] != self.null_block:
            self.free(table[k])
            table[k] = self.null_block
            released, k = released + 1, k - 1
        return released

    def allocate_slots(self, table: list[int], num_computed: int,
                       num_new: int) -> tuple[bool, tuple[int, int] | None]:
        """Blocks for tokens [num_computed, num_computed + num_new) of the owner of ``table``.

        The block the first new token lands in is copied when it is partial and shared (the
        owner moves to a fresh block), then the table grows to cover the last new token; all
        or nothing. Returns (False, None) when the pool is short (nothing changed), else
        (True, the (src, dst) copy or None).
        """
        bs = self.block_size
        need = max(-(-(num_computed + num_new) // bs) - len(table), 0)
        k = num_computed // bs
        cow = num_computed % bs != 0 and self.ref_counts[table[k]] > 1
        if need + cow > self.num_free_blocks:
            return False, None
        copy = None
        if cow:
            fresh = self.allocate()
            self.ref_counts[table[k]] -= 1          # shared: stays owned by the others
            copy, table[k] = (table[k], fresh), fresh
        table.extend(self.allocate() for _ in range(need))
        return True, copy

    def debug_state(self) -> dict:
        """The Cython allocator's debug_state(): ``ref_counts``, ``evictable`` (LRU first),
        ``free_list`` (parked most recent first, then the stack bottom to top),
        ``null_block``."""
        evictable = list(self.prefix_cache.parked) if self.prefix_cache else []
        return {"ref_counts": np.array(self.ref_counts, dtype=np.int32), "evictable": evictable,
                "free_list": np.array(evictable[::-1] + self.free_stack, dtype=np.int32),
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "null_block": self.null_block}
