# cython: language_level=3
"""C-level declarations of the KV block allocator (see block_allocator.pyx for the rules).

Public C surface for the scheduler (vtable calls, no Python dispatch, GIL released):

* ``allocate_slots`` (vLLM's name): blocks for a sequence's next tokens, copy-on-write of a
  shared partial block, all or nothing;
* ``get_computed_blocks``: on admission, the longest chain of cached full blocks, referenced;
* ``free_blocks`` / ``fork_blocks``: release or share a whole block table; ``free_tail``:
  release its blocks past the first ``keep`` (rejected speculative tokens);
  ``remove_skipped_blocks`` (vLLM's name): release the leading blocks that fell out of every
  sliding window, their entries becoming the reserved ``null_block``;
* ``get_num_free_blocks``; the readonly fields below (also Python attributes).

``c_x`` is the C twin of the Python method ``x`` (tests use the Python face). Every field with
a leading underscore is private to this class.
"""
from libc.stdint cimport int32_t, uint64_t

from nybble.runtime.scheduler.prefix_cache cimport PrefixCache

# Return codes of the C methods (errors cross the nogil boundary as return codes; the Python
# exception is raised afterwards by raise_alloc_error()).
cpdef enum AllocStatus:
    ALLOC_OK = 0
    ALLOC_NO_SPACE = 1      # allocate_slots: the pool is short; nothing changed (capacity)
    ERR_BLOCK_RANGE = -2    # block id outside [0, num_blocks)
    ERR_DOUBLE_FREE = -3    # free (decref) of a block whose ref count is already 0
    ERR_INCREF_FREE = -4    # incref of a block that is free (ref count 0) and not cached
    ERR_WRITE_FREE = -5     # copy-on-write of a block that is free (ref count 0)


cdef class BlockAllocator:
    # ---- public, readonly ----------------------------------------------------------------------
    # field                  type         meaning (units)
    # ---------------------  -----------  -------------------------------------------------------
    # num_blocks             int32        blocks in the pool N (fixed at construction)
    # block_size             int32        tokens per block
    # enable_prefix_caching  bint         prefix caching on (then prefix_cache is set)
    # prefix_cache           PrefixCache  hashes of cached blocks + LRU of parked ones, or None
    # err_block              int32        block id named by the last error code (for messages)
    # null_block             int32        reserved block that stands for the freed leading
    #                                       entries of a table (sliding windows): block 0, never
    #                                       allocated, owned or written; -1 when none is reserved
    cdef readonly int32_t num_blocks
    cdef readonly int32_t null_block
    cdef readonly int32_t block_size
    cdef readonly bint enable_prefix_caching
    cdef readonly PrefixCache prefix_cache
    cdef readonly int32_t err_block

    # ---- private -------------------------------------------------------------------------------
    # _ref_counts   int32[N]  owners per block (block tables listing it)
    # _free_stack   int32[N]  uncached free block ids; [0, _num_free) is live, top is last
    # _num_free     int32     blocks on the free stack
    # NOTE: the invariant. ref count r > 0 <=> listed in exactly r owners' tables; ref count 0
    # <=> exactly one of: on the free stack (uncached), or parked on the prefix cache's LRU list
    # (cached: hash and KV kept). Free blocks = _num_free + prefix_cache.num_evictable_blocks.
    # The null block (when reserved) is the exception: ref count 0, in no free list, and listed
    # any number of times (uncounted) as the leading entries of windowed tables.
    cdef int32_t* _ref_counts
    cdef int32_t* _free_stack
    cdef int32_t _num_free

    cdef int32_t c_allocate(self) noexcept nogil
    cdef int c_free(self, int32_t block_id) noexcept nogil
    cdef int c_incref(self, int32_t block_id) noexcept nogil
    cdef int32_t c_ref_count(self, int32_t block_id) noexcept nogil
    cdef int32_t c_copy_on_write(self, int32_t block_id) noexcept nogil
    cdef int32_t get_num_free_blocks(self) noexcept nogil
    cdef int free_blocks(self, int32_t* table, int32_t* num_blocks) noexcept nogil
    cdef int free_tail(self, int32_t* table, int32_t* num_blocks, int32_t keep) noexcept nogil
    cdef int remove_skipped_blocks(self, int32_t* table, int32_t num_blocks,
                                   int32_t num_skipped) noexcept nogil
    cdef int fork_blocks(self, const int32_t* src, int32_t* dst, int32_t num_blocks) noexcept nogil
    cdef int32_t get_computed_blocks(self, const int32_t* tokens, int32_t max_blocks,
                                     int32_t* table, int32_t* num_blocks,
                                     uint64_t* last_hash) noexcept nogil
    cdef int allocate_slots(self, int32_t* table, int32_t* num_blocks, int32_t num_computed,
                            int32_t num_new, int32_t* copy_src, int32_t* copy_dst) noexcept nogil


cdef int raise_alloc_error(int rc, int32_t block_id) except -1
