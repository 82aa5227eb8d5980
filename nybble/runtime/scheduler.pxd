# cython: language_level=3
"""C-level declarations of the continuous-batching scheduler (rules in scheduler.pyx).

State shared with the update/finish side (sequences, queues, in-flight batch) is declared on
the base class :class:`SeqManager` in seq_manager.pxd.
"""
from libc.stdint cimport int32_t

from nybble.runtime.seq_manager cimport SeqManager


cdef class Scheduler(SeqManager):
    cdef:
        # ---- admission configuration (fixed at construction) --------------------------------
        # field                 type       meaning (units)
        # --------------------  ---------  ----------------------------------------------------
        # _max_num_seqs         int32      cap on running sequences (a group counts num_samples)
        # _max_batched          int32      token budget per step (tokens)
        # _chunked              bint       enable_chunked_prefill
        int32_t _max_num_seqs
        int32_t _max_batched
        bint _chunked

    # GIL released (errors are negative return codes, see block_allocator.AllocStatus)
    cdef int _allocate_for(self, int32_t slot, int32_t n) noexcept nogil
    cdef int _preempt_last(self) noexcept nogil
    cdef int _reuse_prefix(self, int32_t slot) noexcept nogil
    cdef int _schedule_running(self, int32_t* budget) noexcept nogil
    cdef int _schedule_waiting(self, int32_t* budget) noexcept nogil
