# cython: language_level=3
"""C-level declarations of the KV block allocator (see block_allocator.pyx for the rules).

``scheduler.pyx`` cimports :class:`BlockAllocator` from here and calls its ``c_*`` methods
directly (vtable call, no Python dispatch), with the GIL released.
"""
from libc.stdint cimport int32_t

from nybble.runtime.prefix_cache cimport PrefixCache

# Return codes of the c_* methods (errors cross the nogil boundary as return codes; the
# Python exception is raised afterwards by raise_alloc_error()).
cpdef enum AllocStatus:
    ALLOC_OK = 0
    ALLOC_COPIED = 1        # c_cover: a copy-on-write pair was recorded
    ALLOC_NO_SPACE = 2      # c_cover: the pool is short; nothing changed (capacity, not a bug)
    ERR_BLOCK_RANGE = -2    # block id outside [0, num_blocks)
    ERR_DOUBLE_FREE = -3    # free (decref) of a block whose ref count is already 0
    ERR_INCREF_FREE = -4    # incref of a block that is on the free list (ref count 0)
    ERR_WRITE_FREE = -5     # copy-on-write of a block that is on the free list


cdef class BlockAllocator:
    cdef:
        # field          type        meaning (units)
        # -------------  ----------  ----------------------------------------------------
        # _num_blocks    int32       blocks in the pool (fixed at construction)
        # _block_size    int32       tokens per block
        # _num_free      int32       blocks currently on the free stack
        # _ref_counts    int32[N]    owners per block; 0 <=> block is on the free stack
        # _free_stack    int32[N]    free block ids; [0, _num_free) is live, top is last
        # _err_block     int32       block id of the last error code returned (for messages)
        # _caching       bint        prefix caching on (then _cache is set)
        # _cache         PrefixCache hashes of cached blocks + LRU of parked ones, or None;
        #                            a parked block has ref count 0 and counts as free
        int32_t _num_blocks
        int32_t _block_size
        int32_t _num_free
        int32_t* _ref_counts
        int32_t* _free_stack
        int32_t _err_block
        bint _caching
        PrefixCache _cache

    cdef int32_t c_allocate(self) noexcept nogil
    cdef int c_free(self, int32_t block_id) noexcept nogil
    cdef int c_incref(self, int32_t block_id) noexcept nogil
    cdef int32_t c_num_available(self) noexcept nogil
    cdef int32_t c_ref_count(self, int32_t block_id) noexcept nogil
    cdef int32_t c_copy_on_write(self, int32_t block_id) noexcept nogil
    cdef int c_free_table(self, int32_t* table, int32_t* num_blocks) noexcept nogil
    cdef int c_fork_table(self, const int32_t* src, int32_t* dst, int32_t num_blocks) noexcept nogil
    cdef int c_cover(self, int32_t* table, int32_t* num_blocks, int32_t start, int32_t end,
                     int32_t* copy_src, int32_t* copy_dst) noexcept nogil


cdef int raise_alloc_error(int rc, int32_t block_id) except -1
