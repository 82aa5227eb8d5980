# cython: language_level=3
"""Fixed pool of KV-cache blocks with O(1) allocate/free and per-block reference counts.

Rules (over integers; the methods say the details):

* ``allocate`` pops the free stack (block 0 first in a fresh pool), then, with prefix caching,
  evicts the least recently used parked block; an empty pool is a return value (-1 / None):
  capacity, to which the scheduler reacts by preempting.
* ``free`` drops a reference; at 0 a cached block is parked on the prefix cache's LRU list
  (hash and KV kept), any other goes back on the free stack. ``incref`` adds one to an owned
  block (sharing) or a parked one (a prefix hit takes it off the LRU list).
* ``copy_on_write`` and ``allocate_slots`` give a writer a private copy of a shared block.

NOTE: the invariant. Prefix caching parks blocks, so "free" is not "on the free stack": a
block with ref count r > 0 is listed in exactly r owners' block tables; a block with ref count
0 is either on the free stack (uncached) or parked on the :class:`PrefixCache` LRU list
(cached), never both; an allocation may take either kind (``num_free_blocks`` counts both).

Sliding windows (vLLM's ``SlidingWindowManager``): with ``reserve_null_block`` block 0 is
taken out of the pool for good (the *null block*: never allocated, owned, cached or written,
ref count 0, in no free list) and ``remove_skipped_blocks`` frees the leading blocks of a
table that fell out of every window, pointing their entries at it, so a kernel that reads a
masked-out block still reads a valid (zero) block. Table-level frees and forks skip null
entries.

Corruption (double free, incref of a free block, an id outside the pool) is never a return
value for Python callers: it raises :class:`RuntimeError` naming the block and saying it is a
bug. No torch is imported here.
"""
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, uint64_t

import numpy as np

from nybble.runtime.scheduler.prefix_cache cimport PrefixCache


_ERR_MSG = {ERR_BLOCK_RANGE: "is outside the pool",
            ERR_DOUBLE_FREE: "was freed while its ref count is already 0 (double free)",
            ERR_INCREF_FREE: "was incref'd while it is free (ref count 0)",
            ERR_WRITE_FREE: "was written (copy-on-write) while it is free (ref count 0)"}


cdef int raise_alloc_error(int rc, int32_t block_id) except -1:
    """Raise the RuntimeError matching an ``AllocStatus`` error code; return 0 for ALLOC_OK."""
    if rc == ALLOC_OK:
        return 0
    msg = _ERR_MSG.get(rc, f"hit unknown allocator error code {rc}")
    raise RuntimeError(f"KV block {block_id} {msg}; this is a bug in the caller's bookkeeping")


cdef class BlockAllocator:
    """A pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    Args:
        num_blocks: blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: keep freed full blocks findable by content (a PrefixCache).
        reserve_null_block: take block 0 out of the pool as the null block (sliding-window
            freeing, see the module docstring); the pool then hands out ``num_blocks - 1``.

    Raises:
        ValueError: a size is below 1 (below 2 with ``reserve_null_block``).
        MemoryError: the C arrays could not be allocated.
    """

    def __cinit__(self, int num_blocks, int block_size, bint enable_prefix_caching=False,
                  bint reserve_null_block=False):
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"`num_blocks` must be >= {1 + reserve_null_block}"
                             f"{' (one is the null block)' if reserve_null_block else ''}, "
                             f"got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = <int32_t*> PyMem_Malloc(num_blocks * sizeof(int32_t))
        self._free_stack = <int32_t*> PyMem_Malloc(num_blocks * sizeof(int32_t))
        if self._ref_counts == NULL or self._free_stack == NULL:
            raise MemoryError(f"could not allocate bookkeeping for {num_blocks} KV blocks")
        cdef int32_t i
        for i in range(num_blocks):
            self._ref_counts[i] = 0
            # Block 0 on top, so a fresh pool hands out 0, 1, 2, ... (readable in tests/logs).
            self._free_stack[i] = num_blocks - 1 - i
        self._num_free = num_blocks
        self.null_block = -1
        if reserve_null_block:      # block 0 (the top of the stack) never comes out of it
            self._num_free -= 1
            self.null_block = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache(num_blocks, block_size) if enable_prefix_caching else None

    def __dealloc__(self):
        PyMem_Free(self._ref_counts)
        PyMem_Free(self._free_stack)

    # ---- C face: single blocks (GIL released) ------------------------------------------------

    cdef int32_t c_allocate(self) noexcept nogil:
        """Pop a free block, else evict the LRU parked one (ref count becomes 1); return its
        id, or -1 when the pool is empty."""
        cdef int32_t block_id
        if self._num_free > 0:
            self._num_free -= 1
            block_id = self._free_stack[self._num_free]
        elif self.enable_prefix_caching:
            block_id = self.prefix_cache.evict()
            if block_id < 0:
                return -1
        else:
            return -1
        self._ref_counts[block_id] = 1
        return block_id

    cdef int c_free(self, int32_t block_id) noexcept nogil:
        """Drop one reference; at none, park a cached block, stack any other."""
        if block_id < 0 or block_id >= self.num_blocks or self._ref_counts[block_id] <= 0:
            self.err_block = block_id
            return ERR_BLOCK_RANGE if block_id < 0 or block_id >= self.num_blocks \
                else ERR_DOUBLE_FREE
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self.enable_prefix_caching and self.prefix_cache.is_cached(block_id):
                self.prefix_cache.park(block_id)
            else:
                self._free_stack[self._num_free] = block_id
                self._num_free += 1
        return ALLOC_OK

    cdef int c_incref(self, int32_t block_id) noexcept nogil:
        """Add one reference to an owned block (sharing) or to a parked cached block (a
        prefix hit; it leaves the LRU list); any other free block is an error code."""
        if block_id < 0 or block_id >= self.num_blocks:
            self.err_block = block_id
            return ERR_BLOCK_RANGE
        if self._ref_counts[block_id] == 0:
            if not (self.enable_prefix_caching and self.prefix_cache.is_cached(block_id)):
                self.err_block = block_id
                return ERR_INCREF_FREE
            self.prefix_cache.unpark(block_id)
        self._ref_counts[block_id] += 1
        return ALLOC_OK

    cdef int32_t c_ref_count(self, int32_t block_id) noexcept nogil:
        """Ref count of ``block_id``; -1 for an id outside the pool."""
        if block_id < 0 or block_id >= self.num_blocks:
            return -1
        return self._ref_counts[block_id]

    cdef int32_t c_copy_on_write(self, int32_t block_id) noexcept nogil:
        """Block to write instead of ``block_id``: itself when unshared, else a fresh block
        (this owner's reference moves to it). -1 when the pool is empty; ERR_BLOCK_RANGE or
        ERR_WRITE_FREE on a bad id."""
        cdef int32_t ref = self.c_ref_count(block_id), fresh
        if ref <= 0:
            self.err_block = block_id
            return ERR_BLOCK_RANGE if ref < 0 else ERR_WRITE_FREE
        if ref == 1:
            return block_id
        fresh = self.c_allocate()
        if fresh >= 0:
            self._ref_counts[block_id] -= 1     # ref > 1: stays owned, never freed here
        return fresh

    cdef int32_t get_num_free_blocks(self) noexcept nogil:
        """Blocks an allocation may take: the free stack plus the parked cached blocks."""
        return self._num_free + (self.prefix_cache.num_evictable_blocks
                                 if self.enable_prefix_caching else 0)

    # ---- C face: block tables, for the scheduler (GIL released) -------------------------------

    cdef int free_blocks(self, int32_t* table, int32_t* num_blocks) noexcept nogil:
        """Free a block table, last block first (so a parked chain is evicted tail first);
        freed entries become -1 and ``num_blocks[0]`` drops to 0 (on an error it stops at the
        bad entry, named by ``err_block``)."""
        return self.free_tail(table, num_blocks, 0)

    cdef int free_tail(self, int32_t* table, int32_t* num_blocks, int32_t keep) noexcept nogil:
        """Free the entries of a block table past its first ``keep``, last first (speculative
        decoding: blocks only rejected drafts used); as :meth:`free_blocks` otherwise."""
        cdef int rc
        cdef int32_t block
        while num_blocks[0] > keep:
            block = table[num_blocks[0] - 1]
            if block != self.null_block:
                rc = self.c_free(block)
                if rc != ALLOC_OK:
                    return rc
            table[num_blocks[0] - 1] = -1
            num_blocks[0] -= 1
        return ALLOC_OK

    cdef int fork_blocks(self, const int32_t* src, int32_t* dst, int32_t num_blocks) noexcept nogil:
        """Copy ``num_blocks`` entries of ``src`` into ``dst``, adding one reference to each
        (null entries are copied, no reference taken)."""
        cdef int32_t k
        cdef int rc
        for k in range(num_blocks):
            if src[k] != self.null_block:
                rc = self.c_incref(src[k])
                if rc != ALLOC_OK:
                    return rc
            dst[k] = src[k]
        return ALLOC_OK

    cdef int remove_skipped_blocks(self, int32_t* table, int32_t num_blocks,
                                   int32_t num_skipped) noexcept nogil:
        """Sliding windows (vLLM's ``SlidingWindowManager.remove_skipped_blocks``): drop this
        table's reference to each of its first ``num_skipped`` blocks (capped at
        ``num_blocks``, the valid entries) that is not yet the null block, last first, and
        point those entries at the null block. Freed entries are a prefix of the table, so the
        walk stops at the first null entry met. A block shared with another table (fork,
        prefix hit) stays alive for it; a cached one is parked (still findable). Returns the
        blocks released (>= 0) or an error code (< 0)."""
        cdef int32_t k = min(num_skipped, num_blocks) - 1, released = 0
        cdef int rc
        while k >= 0 and table[k] != self.null_block:
            rc = self.c_free(table[k])
            if rc != ALLOC_OK:
                return rc
            table[k] = self.null_block
            released += 1
            k -= 1
        return released

    cdef int32_t get_computed_blocks(self, const int32_t* tokens, int32_t max_blocks,
                                     int32_t* table, int32_t* num_blocks,
                                     uint64_t* last_hash) noexcept nogil:
        """Admission with prefix caching: point an empty block ``table`` at the longest chain
        of cached full blocks of ``tokens`` (at most ``max_blocks``), taking a reference to
        each; ``num_blocks[0]`` and ``last_hash[0]`` (hash of the last hit) are set. Returns
        the hit blocks, or an error code (``num_blocks[0]`` then counts the referenced ones)."""
        cdef int32_t j, k = self.prefix_cache.c_match(tokens, max_blocks, table, last_hash)
        cdef int rc
        for j in range(k):
            rc = self.c_incref(table[j])
            if rc != ALLOC_OK:
                num_blocks[0] = j
                return rc
        num_blocks[0] = k
        return k

    cdef int allocate_slots(self, int32_t* table, int32_t* num_blocks, int32_t num_computed,
                            int32_t num_new, int32_t* copy_src, int32_t* copy_dst) noexcept nogil:
        """Give one sequence KV slots for tokens [num_computed, num_computed + num_new).

        Token regions of one sequence (its table covers at least the computed ones)::

            |<- prefix hit ->|<- computed ->|<----- new ----->|<- lookahead ->|
            |<-------- num_computed ------->|<--- num_new --->|  vLLM only    |
            | cached blocks, | earlier      |  written by     |  (speculative |
            | shared         | forwards     |  this step      |  decoding)    |
            [ blk 0 .. h-1  ][ ..  ][   blk k     ][ new blocks ..  ]
                                            ^ num_computed: the first write lands in
                                              blk k, copied first if partial and shared

            blocks to add = ceil((num_computed + num_new) / block_size) - num_blocks[0]

        The prefix hit (``get_computed_blocks``, on admission) is whole blocks, so no write
        lands in a cached block; no lookahead slots are reserved here. All or nothing: when
        the copy of blk k plus the new blocks exceed the free blocks, nothing changes;
        otherwise ``copy_src[0] -> copy_dst[0]`` is the KV copy to do before the forward (both
        -1 when none) and the table grows in place.

        Returns:
            ALLOC_OK, ALLOC_NO_SPACE (nothing changed; capacity, not a bug) or an error code.
        """
        cdef int32_t bs = self.block_size, cow = -1
        cdef int32_t need = (num_computed + num_new + bs - 1) // bs - num_blocks[0]
        if need < 0:
            need = 0
        if num_computed % bs != 0 and self.c_ref_count(table[num_computed // bs]) > 1:
            cow = num_computed // bs
        if need + (cow >= 0) > self.get_num_free_blocks():
            return ALLOC_NO_SPACE
        copy_src[0] = copy_dst[0] = -1
        if cow >= 0:
            copy_src[0] = table[cow]
            copy_dst[0] = table[cow] = self.c_copy_on_write(table[cow])  # ref > 1, a free block
        while need > 0:
            table[num_blocks[0]] = self.c_allocate()
            num_blocks[0] += 1
            need -= 1
        return ALLOC_OK

    # ---- Python face (tests, debugging) ------------------------------------------------------

    def allocate(self) -> int | None:
        """Take one free block (ref count 1): its id, or ``None`` when the pool is exhausted
        (capacity, not an error)."""
        cdef int32_t block_id = self.c_allocate()
        return None if block_id < 0 else block_id

    def free(self, int block_id) -> None:
        """Drop one reference to ``block_id``; the block returns to the pool at ref count 0.

        Raises:
            RuntimeError: the block is outside the pool or already free (a bug).
        """
        raise_alloc_error(self.c_free(block_id), block_id)

    def incref(self, int block_id) -> None:
        """Add one reference to an owned block (one more owner) or a parked cached block.

        Raises:
            RuntimeError: the block is outside the pool or free and not cached (a bug).
        """
        raise_alloc_error(self.c_incref(block_id), block_id)

    def fork(self, block_ids) -> None:
        """Share every block of ``block_ids`` (a block table) with one more owner.

        Raises:
            RuntimeError: a block is outside the pool or free (a bug; earlier ones stay shared).
        """
        for b in block_ids:
            raise_alloc_error(self.c_incref(b), b)

    def copy_on_write(self, int block_id) -> int | None:
        """The block an owner of ``block_id`` should write: ``block_id`` itself when it has one
        owner, else a fresh block taking over this owner's reference (copy the KV first), or
        ``None`` when that needs a block and the pool is empty.

        Raises:
            RuntimeError: ``block_id`` is outside the pool or free (a bug).
        """
        cdef int32_t out = self.c_copy_on_write(block_id)
        if out < -1:
            raise_alloc_error(out, block_id)
        return None if out < 0 else out

    def ref_count(self, int block_id) -> int:
        """Owners of ``block_id`` (0 = free).

        Raises:
            ValueError: ``block_id`` is outside ``[0, num_blocks)``.
        """
        if block_id < 0 or block_id >= self.num_blocks:
            raise ValueError(
                f"`block_id` must be in [0, {self.num_blocks}), got {block_id}")
        return self._ref_counts[block_id]

    def register(self, int block_id, uint64_t parent_hash, token_ids) -> int:
        """Cache an owned, full, computed block holding ``token_ids`` (int32[block_size])
        after the block whose hash is ``parent_hash`` (0 for block 0); returns its hash.

        Raises:
            ValueError: prefix caching is off, the block is not owned, or a wrong length.
        """
        cdef const int32_t[::1] tv = np.ascontiguousarray(token_ids, np.int32).reshape(-1)
        if not (self.enable_prefix_caching and tv.shape[0] == self.block_size
                and self.ref_count(block_id) > 0):
            raise ValueError(f"register() needs prefix caching, an owned block and "
                             f"{self.block_size} token ids, got block {block_id} (ref count "
                             f"{self.ref_count(block_id)}), {tv.shape[0]} ids")
        return self.prefix_cache.c_register(block_id, parent_hash, &tv[0])

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free stack plus parked cached blocks."""
        return self.get_num_free_blocks()

    def debug_state(self) -> dict:
        """Copies of the C state for tests: ``ref_counts`` int32[num_blocks], ``free_list``
        int32[num_free_blocks] (every block with ref count 0: parked cached blocks most
        recently used first, then the free stack from the bottom; the next allocation is the
        last), ``evictable`` (parked cached blocks, least recently used first) and
        ``null_block`` (-1: none reserved)."""
        ref_counts = np.array([self._ref_counts[i] for i in range(self.num_blocks)], np.int32)
        evictable = (self.prefix_cache.debug_state()["evictable"]
                     if self.enable_prefix_caching else [])
        stack = [self._free_stack[i] for i in range(self._num_free)]
        return {"ref_counts": ref_counts, "evictable": evictable,
                "free_list": np.array(evictable[::-1] + stack, dtype=np.int32),
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "null_block": self.null_block}
