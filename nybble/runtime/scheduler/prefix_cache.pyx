# cython: language_level=3
"""Automatic prefix caching: full KV blocks found by a hash chained over their token ids.

vLLM V1's scheme (``--enable-prefix-caching``), in C arrays (no torch, no Python objects):

* block ``k`` of a sequence has hash ``h_k = H(h_{k-1}, tokens[k*bs:(k+1)*bs])``, ``h_{-1} = 0``
  (a LoRA adapter's requests chain from their own root ``h_{-1}``: ``Scheduler.add``'s
  ``cache_salt``, so blocks are never shared across adapters)
  (:c:func:`hash_block`, 64-bit), so equal hashes mean equal prefixes, not just equal blocks;
* only **full, computed** blocks are registered (``c_register``): an open-addressing table
  (linear probing, backward-shift deletion, load <= 1/2) maps ``h_k`` to the block id, and the
  block keeps ``h_k``, ``h_{k-1}`` and its token ids. The first block registered under a hash
  wins; a later block with the same content stays uncached (block tables are append-only);
* a lookup (``find``/``c_match``) hits only when the hash, the parent hash **and** the
  block's token ids all match. The residual risk is a 64-bit collision of two chains whose
  block tokens and parent hashes are equal (probability ~2^-64 per pair); it is accepted, as
  in vLLM, whose default hash does not check tokens at all;
* the allocator parks a cached block whose ref count drops to 0 on an LRU list
  (``park``; still counted free, hash and KV kept), takes it back when a request hits it
  (``unpark``) and, once no truly free block is left, reuses the least recently used one
  (``evict``: its hash is dropped).

A cached block is never written: a hit covers whole blocks below ``num_computed``, so every
write lands in a block of its own (at most ``num_tokens - 1`` tokens hit, so the last token is
always computed and sampled).
"""
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import numpy as np


def hash_tokens(uint64_t parent, token_ids) -> int:
    """The chained hash of one block (``parent``: hash of the previous block, 0 for block 0).

    Args:
        parent: unsigned 64-bit parent hash.
        token_ids: 1-D int32 token ids of the block.
    """
    cdef const int32_t[::1] tv = np.ascontiguousarray(token_ids, dtype=np.int32)
    return hash_block(parent, &tv[0] if tv.shape[0] else NULL, <int32_t> tv.shape[0])


cdef class PrefixCache:
    """Hash table + LRU of evictable blocks for a pool of ``num_blocks`` x ``block_size``.

    Created by ``BlockAllocator(..., enable_prefix_caching=True)``, which moves blocks between
    its free stack, the owners and this cache (see the module docstring).

    Raises:
        ValueError: a size is below 1.
        MemoryError: the C arrays could not be allocated.
    """

    def __cinit__(self, int num_blocks, int block_size):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"`num_blocks` and `block_size` must be >= 1, got {num_blocks} "
                             f"and {block_size}")
        cdef int64_t slots = 1, i
        while slots < 2 * num_blocks:
            slots *= 2
        self._num_blocks, self._block_size, self._mask = num_blocks, block_size, slots - 1
        self._keys = <uint64_t*> PyMem_Malloc(slots * sizeof(uint64_t))
        self._slots = <int32_t*> PyMem_Malloc(slots * sizeof(int32_t))
        self._cached = <uint8_t*> PyMem_Malloc(num_blocks * sizeof(uint8_t))
        self._hash = <uint64_t*> PyMem_Malloc(num_blocks * sizeof(uint64_t))
        self._parent = <uint64_t*> PyMem_Malloc(num_blocks * sizeof(uint64_t))
        self._tokens = <int32_t*> PyMem_Malloc(<int64_t> num_blocks * block_size * sizeof(int32_t))
        self._prev = <int32_t*> PyMem_Malloc((num_blocks + 1) * sizeof(int32_t))
        self._next = <int32_t*> PyMem_Malloc((num_blocks + 1) * sizeof(int32_t))
        if (self._keys == NULL or self._slots == NULL or self._cached == NULL
                or self._hash == NULL or self._parent == NULL or self._tokens == NULL
                or self._prev == NULL or self._next == NULL):
            raise MemoryError(f"could not allocate the prefix cache of {num_blocks} KV blocks")
        for i in range(slots):
            self._slots[i] = -1
        memset(self._cached, 0, num_blocks * sizeof(uint8_t))
        self._prev[num_blocks] = self._next[num_blocks] = num_blocks    # empty LRU list

    def __dealloc__(self):
        PyMem_Free(self._keys)
        PyMem_Free(self._slots)
        PyMem_Free(self._cached)
        PyMem_Free(self._hash)
        PyMem_Free(self._parent)
        PyMem_Free(self._tokens)
        PyMem_Free(self._prev)
        PyMem_Free(self._next)

    # ---- C face (GIL released) ---------------------------------------------------------------

    cdef int32_t find(self, uint64_t h, uint64_t parent, const int32_t* tokens) noexcept nogil:
        """The cached block with hash ``h``, parent hash ``parent`` and these token ids, or -1."""
        cdef int64_t i = <int64_t> (h & <uint64_t> self._mask)
        cdef int32_t b, bs = self._block_size
        while self._slots[i] >= 0:
            if self._keys[i] == h:
                b = self._slots[i]
                if (self._parent[b] == parent and memcmp(self._tokens + <int64_t> b * bs,
                                                         tokens, bs * sizeof(int32_t)) == 0):
                    return b
                return -1       # a hash collision: one entry per hash, so a miss
            i = (i + 1) & self._mask
        return -1

    cdef int32_t c_match(self, const int32_t* tokens, int32_t max_blocks, int32_t* out,
                         uint64_t* last_hash) noexcept nogil:
        """Longest chain of cached blocks for ``tokens`` (at most ``max_blocks`` full blocks),
        chained from the root ``last_hash[0]`` (0, or a LoRA adapter's root): writes their ids
        to ``out[0:k]`` (no ref count change), the hash of block k-1 (the root when k == 0) to
        ``last_hash[0]``, and returns k."""
        cdef int32_t k = 0, b, bs = self._block_size
        cdef uint64_t parent = last_hash[0], h
        while k < max_blocks:
            h = hash_block(parent, tokens + <int64_t> k * bs, bs)
            b = self.find(h, parent, tokens + <int64_t> k * bs)
            if b < 0:
                break
            out[k] = b
            parent = h
            k += 1
        last_hash[0] = parent
        return k

    cdef uint64_t c_register(self, int32_t block, uint64_t parent,
                             const int32_t* tokens) noexcept nogil:
        """Cache ``block`` (owned, full, KV computed) holding ``tokens`` after ``parent``;
        returns its hash. No-op when the block is cached already or another block holds the
        hash (first come, first cached)."""
        cdef int32_t bs = self._block_size
        cdef uint64_t h = hash_block(parent, tokens, bs)
        if self._cached[block]:
            return h
        cdef int64_t i = <int64_t> (h & <uint64_t> self._mask)
        while self._slots[i] >= 0:
            if self._keys[i] == h:
                return h
            i = (i + 1) & self._mask
        self._keys[i], self._slots[i] = h, block
        self._cached[block], self._hash[block], self._parent[block] = 1, h, parent
        memcpy(self._tokens + <int64_t> block * bs, tokens, bs * sizeof(int32_t))
        self.num_cached_blocks += 1
        return h

    cdef void cache_full_blocks(self, const int32_t* table, const int32_t* tokens,
                                int32_t num_computed, int32_t* num_hashed,
                                uint64_t* last_hash) noexcept nogil:
        """Register every block of one sequence that is now full and computed: blocks
        ``num_hashed[0]`` .. ``num_computed // block_size - 1`` of ``table`` (its block table)
        holding ``tokens`` (its token ids), chaining from ``last_hash[0]``; both advance."""
        cdef int32_t bs = self._block_size
        while (num_hashed[0] + 1) * bs <= num_computed:
            last_hash[0] = self.c_register(table[num_hashed[0]], last_hash[0],
                                           tokens + <int64_t> num_hashed[0] * bs)
            num_hashed[0] += 1

    cdef void park(self, int32_t block) noexcept nogil:
        """A cached block lost its last owner: append it to the LRU list (most recent last)."""
        cdef int32_t tail = self._prev[self._num_blocks]
        self._prev[block], self._next[block] = tail, self._num_blocks
        self._next[tail] = block
        self._prev[self._num_blocks] = block
        self.num_evictable_blocks += 1

    cdef void unpark(self, int32_t block) noexcept nogil:
        """A parked block was hit: take it off the LRU list (it keeps its hash)."""
        self._next[self._prev[block]] = self._next[block]
        self._prev[self._next[block]] = self._prev[block]
        self.num_evictable_blocks -= 1

    cdef int32_t evict(self) noexcept nogil:
        """Take the least recently used parked block and drop its hash; -1 when none."""
        cdef int32_t block = self._next[self._num_blocks]
        if block == self._num_blocks:
            return -1
        self.unpark(block)
        self._table_remove(block)
        self._cached[block] = 0
        self.num_cached_blocks -= 1
        self.num_evictions += 1
        return block

    cdef void _table_remove(self, int32_t block) noexcept nogil:
        """Delete ``block``'s entry (linear probing with backward-shift deletion: no tombstones,
        every remaining key stays reachable from its home slot)."""
        cdef int64_t i = <int64_t> (self._hash[block] & <uint64_t> self._mask), j, home
        while self._slots[i] != block:
            i = (i + 1) & self._mask
        j = i
        while True:
            j = (j + 1) & self._mask
            if self._slots[j] < 0:
                break
            home = <int64_t> (self._keys[j] & <uint64_t> self._mask)
            # the entry at j may move back to the hole at i unless its home lies in (i, j]
            if (i <= j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            self._keys[i], self._slots[i] = self._keys[j], self._slots[j]
            i = j
        self._slots[i] = -1

    # ---- Python face (tests, debugging) ------------------------------------------------------

    def match(self, token_ids, uint64_t root=0):
        """Block ids of the longest cached chain of full blocks of ``token_ids`` (int32[k])
        from the chain root ``root`` (0; a LoRA adapter's root); ref counts are not touched (the
        scheduler takes references on admission)."""
        tv_arr = np.ascontiguousarray(token_ids, dtype=np.int32).reshape(-1)
        cdef const int32_t[::1] tv = tv_arr
        cdef int32_t max_blocks = tv.shape[0] // self._block_size
        out = np.full(max(max_blocks, 1), -1, np.int32)
        cdef int32_t[::1] ov = out
        cdef uint64_t last = root
        cdef int32_t k = 0
        if max_blocks > 0:
            k = self.c_match(&tv[0], max_blocks, &ov[0], &last)
        return out[:k]

    def debug_state(self) -> dict:
        """Copies for tests: ``hashes`` / ``parents`` (block -> uint64 as int), ``tokens``
        (block -> int32[block_size]) of every cached block, and ``evictable`` (block ids,
        least recently used first)."""
        cdef int32_t b, bs = self._block_size
        hashes, parents, tokens, evictable = {}, {}, {}, []
        for b in range(self._num_blocks):
            if self._cached[b]:
                hashes[b], parents[b] = self._hash[b], self._parent[b]
                tokens[b] = np.array([self._tokens[<int64_t> b * bs + j] for j in range(bs)],
                                     np.int32)
        b = self._next[self._num_blocks]
        while b != self._num_blocks:
            evictable.append(b)
            b = self._next[b]
        return {"hashes": hashes, "parents": parents, "tokens": tokens, "evictable": evictable}
