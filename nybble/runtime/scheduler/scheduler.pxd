# cython: language_level=3
"""C-level declarations of the continuous-batching scheduler (rules in scheduler.pyx).

The Scheduler decides; it is composed of a :class:`SequenceTable` (the sequences and their
queues, which carries the decisions out), a :class:`BlockAllocator` (the KV pool, with its
PrefixCache) and a :class:`BatchBuilder` (the step's output buffers), and reaches them only
through the public C surfaces declared in their .pxd files.
"""
from libc.stdint cimport int32_t, int64_t

from nybble.runtime.scheduler.batch_builder cimport BatchBuilder
from nybble.runtime.scheduler.block_allocator cimport BlockAllocator
from nybble.runtime.scheduler.prefix_cache cimport PrefixCache
from nybble.runtime.scheduler.seq_table cimport SequenceTable


cdef class Scheduler:
    # ---- configuration, fixed at construction (readonly Python attributes) ---------------------
    # field                    type         meaning (units)
    # -----------------------  -----------  -------------------------------------------------------
    # num_blocks               int32        KV blocks in the pool
    # block_size               int32        tokens per KV block
    # max_num_seqs             int32        cap on running sequences (a group counts num_samples)
    # max_num_batched_tokens   int32        token budget per step (tokens)
    # max_model_len            int32        context limit L (tokens)
    # enable_chunked_prefill   bint         split prompts across steps to fill the budget
    # prefix_cache             PrefixCache  the pool's prefix cache (None when caching is off)
    cdef readonly int32_t num_blocks
    cdef readonly int32_t block_size
    cdef readonly int32_t max_num_seqs
    cdef readonly int32_t max_num_batched_tokens
    cdef readonly int32_t max_model_len
    cdef readonly bint enable_chunked_prefill
    cdef readonly PrefixCache prefix_cache
    # num_lookahead_slots      int32        speculative decoding: draft tokens k a decoding
    #                                       sequence may be given per step (0: off); vLLM's name
    # ngram_min / ngram_max    int32        n-gram proposals made here when ngram_max > 0
    # _window                  int32        sliding window W whose out-of-window blocks are
    #                                       freed (tokens; 0: off); Python: ``sliding_window``
    cdef int32_t _window
    cdef readonly int32_t num_lookahead_slots
    cdef readonly int32_t ngram_min
    cdef readonly int32_t ngram_max

    # ---- counters since construction (readonly Python attributes) -----------------------------
    # num_preemptions          int64        preemptions
    # num_prefix_hit_tokens    int64        tokens found in the prefix cache on admission
    # num_prefix_query_tokens  int64        tokens of the sequences admitted with caching on
    cdef readonly int64_t num_preemptions
    cdef readonly int64_t num_prefix_hit_tokens
    cdef readonly int64_t num_prefix_query_tokens
    # num_window_freed_blocks  int64        block references dropped because the blocks fell
    #                                       out of the sliding window
    cdef readonly int64_t num_window_freed_blocks

    # ---- private ------------------------------------------------------------------------------
    # _seqs       SequenceTable   the sequences and their waiting / running queues
    # _allocator  BlockAllocator  the KV block pool
    # _batch      BatchBuilder    rows, sample rows, copy pairs, output buffers
    # _inflight   object          the ScheduledBatch awaiting update(), or None
    cdef SequenceTable _seqs
    cdef BlockAllocator _allocator
    cdef BatchBuilder _batch
    cdef object _inflight

    # GIL released (errors are negative return codes, see block_allocator.AllocStatus)
    cdef int _allocate(self, int32_t slot, int32_t num_new) noexcept nogil
    cdef int _schedule_running(self, int32_t* budget) noexcept nogil
    cdef int _schedule_waiting(self, int32_t* budget) noexcept nogil
    cdef int32_t _num_spec(self, int32_t slot, int32_t budget) noexcept nogil
