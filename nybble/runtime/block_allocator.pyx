# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Fixed pool of KV-cache blocks with O(1) allocate/free and per-block reference counts.

Rules (one line each, over integers):

* ``allocate``: pop the top of the free stack, ref count 0 -> 1; empty stack -> ``-1`` / ``None``
  (capacity is a return value; the scheduler reacts by preempting).
* ``free``: ref count -= 1; when it reaches 0 the block is pushed back on the free stack.
* ``incref`` / ``fork``: ref count += 1 for blocks that are already owned (sharing a prefix)
  or parked in the prefix cache (a prefix hit takes the block off the LRU list).
* ``copy_on_write(b)``: ref count 1 -> ``b`` (write in place); ref count > 1 -> a fresh block
  ``d`` and ``b`` loses this owner (the caller copies KV ``b -> d`` before writing).
* ``c_cover`` (the scheduler's ``allocate_slots``): before writing tokens [start, end) of a
  sequence, copy-on-write the block holding ``start`` when it is partial and shared, then grow
  the table to ``ceil(end / block_size)`` blocks -- all or nothing.
* A block with ref count r is listed in exactly r owners' block tables; a block with ref count
  0 is on the free stack or, with prefix caching, parked in the :class:`PrefixCache` LRU.
* Prefix caching (off by default): ``free`` parks a cached block at ref count 0 instead of
  stacking it (hash and KV kept, still counted free); ``allocate`` pops the free stack
  first and only then evicts the least recently used parked block (dropping its hash).

Corruption (double free, incref of a free block, an id outside the pool) is never a return
value for Python callers: it raises :class:`RuntimeError` naming the block and saying it is a
bug. No torch is imported here.
"""
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, uint64_t

import numpy as np

from nybble.runtime.prefix_cache cimport PrefixCache


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

    Raises:
        ValueError: a size is below 1.
        MemoryError: the C arrays could not be allocated.
    """

    def __cinit__(self, int num_blocks, int block_size, bint enable_prefix_caching=False):
        if num_blocks < 1:
            raise ValueError(f"`num_blocks` must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
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
        self._caching = enable_prefix_caching
        self._cache = PrefixCache(num_blocks, block_size) if enable_prefix_caching else None

    def __dealloc__(self):
        PyMem_Free(self._ref_counts)
        PyMem_Free(self._free_stack)

    # ---- C face (scheduler hot loop; GIL released) -------------------------------------------

    cdef int32_t c_allocate(self) noexcept nogil:
        """Pop a free block, else evict the LRU parked one (ref count becomes 1); return its
        id, or -1 when the pool is empty."""
        cdef int32_t block_id
        if self._num_free > 0:
            self._num_free -= 1
            block_id = self._free_stack[self._num_free]
        elif self._caching:
            block_id = self._cache.c_evict()
            if block_id < 0:
                return -1
        else:
            return -1
        self._ref_counts[block_id] = 1
        return block_id

    cdef int c_free(self, int32_t block_id) noexcept nogil:
        """Drop one reference; push the block on the free stack when none is left."""
        if block_id < 0 or block_id >= self._num_blocks or self._ref_counts[block_id] <= 0:
            self._err_block = block_id
            return ERR_BLOCK_RANGE if block_id < 0 or block_id >= self._num_blocks \
                else ERR_DOUBLE_FREE
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self._caching and self._cache._cached[block_id]:
                self._cache.c_park(block_id)
            else:
                self._free_stack[self._num_free] = block_id
                self._num_free += 1
        return ALLOC_OK

    cdef int c_incref(self, int32_t block_id) noexcept nogil:
        """Add one reference to an owned block (sharing) or to a parked cached block (a
        prefix hit; it leaves the LRU list); any other free block is an error code."""
        if block_id < 0 or block_id >= self._num_blocks:
            self._err_block = block_id
            return ERR_BLOCK_RANGE
        if self._ref_counts[block_id] == 0:
            if not (self._caching and self._cache._cached[block_id]):
                self._err_block = block_id
                return ERR_INCREF_FREE
            self._cache.c_unpark(block_id)
        self._ref_counts[block_id] += 1
        return ALLOC_OK

    cdef int32_t c_num_available(self) noexcept nogil:
        """Blocks an allocation may take: the free stack plus the parked cached blocks."""
        return self._num_free + (self._cache._num_evictable if self._caching else 0)

    cdef int32_t c_ref_count(self, int32_t block_id) noexcept nogil:
        """Ref count of ``block_id``; -1 for an id outside the pool."""
        if block_id < 0 or block_id >= self._num_blocks:
            return -1
        return self._ref_counts[block_id]

    cdef int32_t c_copy_on_write(self, int32_t block_id) noexcept nogil:
        """Block to write instead of ``block_id``: itself when unshared, else a fresh block
        (this owner's reference moves to it). -1 when the pool is empty; ERR_BLOCK_RANGE or
        ERR_WRITE_FREE on a bad id."""
        cdef int32_t ref = self.c_ref_count(block_id), fresh
        if ref <= 0:
            self._err_block = block_id
            return ERR_BLOCK_RANGE if ref < 0 else ERR_WRITE_FREE
        if ref == 1:
            return block_id
        fresh = self.c_allocate()
        if fresh >= 0:
            self._ref_counts[block_id] -= 1     # ref > 1: stays owned, never freed here
        return fresh

    cdef int c_free_table(self, int32_t* table, int32_t* num_blocks) noexcept nogil:
        """Free a block table, last block first; freed entries become -1 and ``num_blocks[0]``
        drops to 0 (on an error it stops at the bad entry, named by ``_err_block``)."""
        cdef int rc
        while num_blocks[0] > 0:
            rc = self.c_free(table[num_blocks[0] - 1])
            if rc != ALLOC_OK:
                return rc
            table[num_blocks[0] - 1] = -1
            num_blocks[0] -= 1
        return ALLOC_OK

    cdef int c_fork_table(self, const int32_t* src, int32_t* dst, int32_t num_blocks) noexcept nogil:
        """Copy ``num_blocks`` entries of ``src`` into ``dst``, adding one reference to each."""
        cdef int32_t k
        cdef int rc
        for k in range(num_blocks):
            rc = self.c_incref(src[k])
            if rc != ALLOC_OK:
                return rc
            dst[k] = src[k]
        return ALLOC_OK

    cdef int c_cover(self, int32_t* table, int32_t* num_blocks, int32_t start, int32_t end,
                     int32_t* copy_src, int32_t* copy_dst) noexcept nogil:
        """Prepare a table for writing tokens [start, end) (``start`` <= tokens it covers).

        Returns ALLOC_OK, ALLOC_COPIED (``copy_src[0] -> copy_dst[0]`` recorded),
        ALLOC_NO_SPACE (nothing changed) or a negative error code.
        """
        cdef int32_t bs = self._block_size, need = (end + bs - 1) // bs - num_blocks[0]
        cdef int32_t cow = -1, fresh
        if need < 0:
            need = 0
        if start % bs != 0 and self.c_ref_count(table[start // bs]) > 1:
            cow = start // bs
        if need + (cow >= 0) > self.c_num_available():
            return ALLOC_NO_SPACE
        if cow >= 0:
            fresh = self.c_copy_on_write(table[cow])    # ref > 1 and a free block: succeeds
            copy_src[0], copy_dst[0], table[cow] = table[cow], fresh, fresh
        while need > 0:
            table[num_blocks[0]] = self.c_allocate()
            num_blocks[0] += 1
            need -= 1
        return ALLOC_COPIED if cow >= 0 else ALLOC_OK

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
        """Share every block of ``block_ids`` (1-D owned ids, a block table) with one more
        owner (incref each, in order).

        Raises:
            RuntimeError: a block is outside the pool or free (a bug); earlier ones keep
                their extra reference.
        """
        for b in block_ids:
            raise_alloc_error(self.c_incref(b), b)

    def copy_on_write(self, int block_id) -> int | None:
        """The block an owner of ``block_id`` should write: ``block_id`` itself when it has one
        owner, else a fresh block that takes over this owner's reference (copy the KV first).

        Returns:
            A block id, or ``None`` when a fresh block is needed and the pool is empty.

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
        if block_id < 0 or block_id >= self._num_blocks:
            raise ValueError(
                f"`block_id` must be in [0, {self._num_blocks}), got {block_id}")
        return self._ref_counts[block_id]

    def register(self, int block_id, uint64_t parent_hash, token_ids) -> int:
        """Cache an owned, full, computed block holding ``token_ids`` (int32[block_size])
        after the block whose hash is ``parent_hash`` (0 for block 0); returns its hash.

        Raises:
            ValueError: prefix caching is off, the block is not owned, or a wrong length.
        """
        cdef const int32_t[::1] tv = np.ascontiguousarray(token_ids, np.int32).reshape(-1)
        if not (self._caching and tv.shape[0] == self._block_size
                and self.ref_count(block_id) > 0):
            raise ValueError(f"register() needs prefix caching, an owned block and "
                             f"{self._block_size} token ids, got block {block_id} (ref count "
                             f"{self.ref_count(block_id)}), {tv.shape[0]} ids")
        return self._cache.c_register(block_id, parent_hash, &tv[0])

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The :class:`PrefixCache` (None when prefix caching is off)."""
        return self._cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free stack plus parked cached blocks."""
        return self.c_num_available()

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    def debug_state(self) -> dict:
        """Copies of the C state for tests: ``ref_counts`` int32[num_blocks], ``free_list``
        int32[num_free_blocks] (every block with ref count 0: parked cached blocks most
        recently used first, then the free stack from the bottom; the next allocation is the
        last) and ``evictable`` (parked cached blocks, least recently used first)."""
        ref_counts = np.array([self._ref_counts[i] for i in range(self._num_blocks)], np.int32)
        evictable = self._cache.debug_state()["evictable"] if self._caching else []
        stack = [self._free_stack[i] for i in range(self._num_free)]
        return {"ref_counts": ref_counts, "evictable": evictable,
                "free_list": np.array(evictable[::-1] + stack, dtype=np.int32),
                "num_blocks": self._num_blocks, "block_size": self._block_size}
