# cython: language_level=3
"""C-level declarations of the prefix cache (rules in prefix_cache.pyx).

:class:`BlockAllocator` owns one :class:`PrefixCache` when prefix caching is on. Public C
surface (GIL released):

* for the allocator: ``is_cached``, ``park`` / ``unpark`` / ``evict`` (the LRU of parked
  blocks), ``num_evictable_blocks``;
* for admission (``BlockAllocator.get_computed_blocks``): ``c_match`` (C twin of the Python
  ``match``; ``find`` looks up one block);
* for a step's update: ``cache_full_blocks`` (registers a sequence's newly full, computed
  blocks through ``c_register``, the C twin of ``BlockAllocator.register``).

The readonly counters are Python attributes too. Every other field is private.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t


cdef inline uint64_t _rotl64(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t hash_block(uint64_t parent, const int32_t* tokens, int32_t n) noexcept nogil:
    """Chained 64-bit hash of one full block: H(parent hash, n int32 token ids).

    xxHash64's round (multiply, rotate 31, multiply) per token, seeded with the parent hash,
    then murmur3's fmix64 avalanche. The parent of block 0 is ``0``.
    """
    cdef uint64_t acc = parent * 0x9E3779B185EBCA87ULL + 0x27D4EB2F165667C5ULL
    cdef int32_t i
    for i in range(n):
        acc = _rotl64(acc + <uint64_t> (<uint32_t> tokens[i]) * 0xC2B2AE3D27D4EB4FULL, 31)
        acc = acc * 0x9E3779B185EBCA87ULL
    acc ^= acc >> 33
    acc *= 0xFF51AFD7ED558CCDULL
    acc ^= acc >> 33
    acc *= 0xC4CEB9FE1A85EC53ULL
    acc ^= acc >> 33
    return acc


cdef class PrefixCache:
    cdef:
        # field            type          meaning (units)
        # ---------------  ------------  ---------------------------------------------------
        # _num_blocks      int32         N, blocks in the pool
        # _block_size      int32         tokens per block
        # _mask            int64         hash-table slots - 1 (slots: power of two >= 2N)
        # _keys            uint64[S]     block hash per table slot
        # _slots           int32[S]      block id per table slot; -1 = empty
        # _cached          uint8[N]      1 = the block has a hash (it is in the table)
        # _hash            uint64[N]     hash of a cached block
        # _parent          uint64[N]     parent hash of a cached block (collision check)
        # _tokens          int32[N, bs]  token ids of a cached block (collision check)
        # _prev / _next    int32[N + 1]  LRU list of evictable blocks; sentinel N, head = LRU
        # num_cached_blocks     int32    blocks with a hash (readonly)
        # num_evictable_blocks  int32    cached blocks with ref count 0, on the LRU list; the
        #                                allocator counts them free (readonly)
        # num_evictions         int64    cached blocks reused for new content since start
        #                                (readonly)
        int32_t _num_blocks
        int32_t _block_size
        int64_t _mask
        uint64_t* _keys
        int32_t* _slots
        uint8_t* _cached
        uint64_t* _hash
        uint64_t* _parent
        int32_t* _tokens
        int32_t* _prev
        int32_t* _next
    cdef readonly int32_t num_cached_blocks
    cdef readonly int32_t num_evictable_blocks
    cdef readonly int64_t num_evictions

    cdef inline bint is_cached(self, int32_t block) noexcept nogil:
        """True when ``block`` has a hash (owned or parked)."""
        return self._cached[block]

    cdef int32_t find(self, uint64_t h, uint64_t parent, const int32_t* tokens) noexcept nogil
    cdef int32_t c_match(self, const int32_t* tokens, int32_t max_blocks, int32_t* out,
                         uint64_t* last_hash) noexcept nogil
    cdef uint64_t c_register(self, int32_t block, uint64_t parent,
                             const int32_t* tokens) noexcept nogil
    cdef void cache_full_blocks(self, const int32_t* table, const int32_t* tokens,
                                int32_t num_computed, int32_t* num_hashed,
                                uint64_t* last_hash) noexcept nogil
    cdef void park(self, int32_t block) noexcept nogil
    cdef void unpark(self, int32_t block) noexcept nogil
    cdef int32_t evict(self) noexcept nogil
    cdef void _table_remove(self, int32_t block) noexcept nogil
