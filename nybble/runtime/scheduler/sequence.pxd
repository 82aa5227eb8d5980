# cython: language_level=3
"""Per-sequence C state of the scheduler: the finish codes, structs and inline helpers.

A sequence lives in one slot of a :c:type:`SlotStore` (the per-slot arrays: struct arrays with
capacity doubling, sklearn's ``Node*`` + ``safe_realloc`` pattern), owned by a
:class:`~nybble.runtime.scheduler.seq_table.SequenceTable`. Its token ids live in the store's
flat int32 arena in one region ``[stop ids (num_stop) | token ids (cap_tokens)]``; its block
table is row ``slot`` of ``tables`` (int32[cap, max_blocks], padding -1;
:c:func:`block_table_row`). The helpers are compiled into each module that cimports them
(seq_table, scheduler, batch_builder); the ``store_*`` functions that may allocate hold the
GIL, the rest are ``noexcept nogil``. sequence.pyx makes :class:`FinishReason` importable
from Python.
"""
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy


cdef enum SeqStatus:
    SEQ_FREE = 0        # slot unused (on the free-slot stack)
    SEQ_WAITING = 1     # in the waiting queue (new, or preempted: num_computed == 0, no blocks)
    SEQ_RUNNING = 2     # in the running list, owns blocks covering num_computed tokens


cpdef enum FinishReason:
    """Finish codes of ``Scheduler.update()`` / ``finish()``, ordered; NONE (0) = running.

    Declared once here for the Cython core; Python imports it from
    ``nybble.runtime.scheduler.sequence`` as an IntEnum (the engine maps it to OpenAI strings).
    """
    NONE = 0        # still running
    STOPPED = 1     # sampled a stop token id (or a stop string, via finish())
    LENGTH = 2      # max_tokens generated or max_model_len reached
    ABORTED = 3     # aborted via finish(), or finished before its in-flight batch returned


ctypedef struct SeqState:
    # field              type    meaning (units)
    # -----------------  ------  --------------------------------------------------------------
    # seq_id             int64   engine-chosen id (a group owns seq_id .. seq_id+num_samples-1)
    # status             int32   SeqStatus
    # num_prompt_tokens  int32   original prompt length P (tokens); generated = num_tokens - P
    # num_tokens         int32   prompt + generated (tokens)
    # num_computed       int32   tokens whose KV is written (advanced by update())
    # num_scheduled      int32   tokens scheduled in the in-flight batch (0 otherwise)
    # num_spec           int32   speculative decoding: draft tokens among them, kept as scratch
    #                            at token ids [num_tokens, num_tokens + num_spec) (0 otherwise)
    # max_tokens         int32   generation budget (tokens)
    # cap_tokens         int32   token capacity of the region: max(min(P+max_tokens, L), P+1)
    # num_samples        int32   > 1 only for a group parent that has not forked yet
    # num_blocks         int32   valid entries of its block-table row (blocks)
    # num_stop           int32   stop ids at the front of the region
    # region_off         int64   arena offset of the region (int32 elements)
    # num_hashed         int32   prefix caching: leading full blocks registered/hit (blocks)
    # last_hash          uint64  prefix caching: chained hash of block num_hashed-1 (hash_root:
    #                            none)
    # hash_root          uint64  prefix caching: the chain's root h_{-1} (0; a LoRA adapter's
    #                            requests start from their own root, so no KV is shared
    #                            across adapters)
    # skip_cache         int32   1: never take cached blocks (every prompt position is computed,
    #                            e.g. for prompt logprobs); its full blocks are still registered
    int64_t seq_id
    int32_t status
    int32_t num_prompt_tokens
    int32_t num_tokens
    int32_t num_computed
    int32_t num_scheduled
    int32_t num_spec
    int32_t max_tokens
    int32_t cap_tokens
    int32_t num_samples
    int32_t num_blocks
    int32_t num_stop
    int64_t region_off
    int32_t num_hashed
    uint64_t last_hash
    uint64_t hash_root
    int32_t skip_cache

ctypedef struct SlotStore:
    # field        type            meaning (units)
    # -----------  --------------  ---------------------------------------------------------
    # seqs         SeqState[cap]   per-slot state
    # cap          int32           slot capacity (16, then doubling)
    # free_slots   int32[cap]      stack of unused slots, [0, num_free) live
    # num_free     int32           unused slots
    # tables       int32[cap, MB]  block table per slot, padding -1
    # max_blocks   int64           MB = ceil(max_model_len / block_size) (blocks)
    # running      int32[cap]      running queue storage (slots; grows with cap)
    # waiting      int32[cap]      waiting queue storage (slots; grows with cap)
    # arena        int32[A]        token regions, bump allocated, compacted when full
    # arena_cap    int64           A (int32 elements)
    # arena_used   int64           high-water mark (elements)
    # arena_live   int64           elements in live regions
    SeqState* seqs
    int32_t cap
    int32_t* free_slots
    int32_t num_free
    int32_t* tables
    int64_t max_blocks
    int32_t* running
    int32_t* waiting
    int32_t* arena
    int64_t arena_cap
    int64_t arena_used
    int64_t arena_live


cdef inline int32_t cdiv(int32_t a, int32_t b) noexcept nogil:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return (a + b - 1) // b


cdef inline int64_t region_size(SeqState* s) noexcept nogil:
    """Arena elements owned by ``s``: its stop ids plus its token capacity."""
    return <int64_t> s.num_stop + s.cap_tokens


cdef inline int32_t* seq_tokens(SlotStore* st, SeqState* s) noexcept nogil:
    """Token ids of ``s`` (num_tokens valid, cap_tokens capacity)."""
    return st.arena + s.region_off + s.num_stop


cdef inline int32_t* block_table_row(SlotStore* st, int32_t slot) noexcept nogil:
    """Block-table row of ``slot`` (num_blocks valid, then -1)."""
    return st.tables + slot * st.max_blocks


cdef inline FinishReason append_token(SlotStore* st, SeqState* s, int32_t token,
                                      int32_t max_model_len) noexcept nogil:
    """Append a sampled ``token`` to ``s``: STOPPED when it is one of its stop ids, else LENGTH
    once max_tokens are generated or max_model_len is reached, else NONE (vLLM's check_stop)."""
    cdef int32_t j
    seq_tokens(st, s)[s.num_tokens] = token
    s.num_tokens += 1
    for j in range(s.num_stop):
        if st.arena[s.region_off + j] == token:
            return FinishReason.STOPPED
    if s.num_tokens - s.num_prompt_tokens >= s.max_tokens or s.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return FinishReason.NONE


cdef inline void* grow_buffer(void* ptr, size_t nbytes) except NULL:
    """PyMem_Realloc that raises MemoryError instead of returning NULL."""
    cdef void* out = PyMem_Realloc(ptr, nbytes if nbytes > 0 else 1)
    if out == NULL:
        raise MemoryError(f"could not allocate {nbytes} bytes of scheduler state")
    return out


cdef inline int store_grow(SlotStore* st) except -1:
    """Double the slot capacity (16 at first) of every per-slot array."""
    cdef int32_t old = st.cap, new = 2 * st.cap if st.cap else 16
    cdef int64_t i
    st.seqs = <SeqState*> grow_buffer(st.seqs, new * sizeof(SeqState))
    st.tables = <int32_t*> grow_buffer(st.tables, new * st.max_blocks * sizeof(int32_t))
    st.running = <int32_t*> grow_buffer(st.running, new * sizeof(int32_t))
    st.waiting = <int32_t*> grow_buffer(st.waiting, new * sizeof(int32_t))
    st.free_slots = <int32_t*> grow_buffer(st.free_slots, new * sizeof(int32_t))
    for i in range(old * st.max_blocks, new * st.max_blocks):
        st.tables[i] = -1
    for i in range(new - 1, old - 1, -1):   # lowest new slot ends on top of the stack
        st.seqs[i].status = SEQ_FREE
        st.free_slots[st.num_free] = <int32_t> i
        st.num_free += 1
    st.cap = new
    return 0


cdef inline int64_t store_arena_alloc(SlotStore* st, int64_t size) except -1:
    """Bump-allocate ``size`` elements; when full, copy live regions into a buffer of
    ``max(cap, 2 * (live + size))`` (amortized O(1) per element, at least half free after)."""
    cdef int64_t new_cap, off = 0, n
    cdef int32_t* fresh
    cdef int32_t slot
    if st.arena_used + size > st.arena_cap:
        new_cap = max(st.arena_cap, 2 * (st.arena_live + size), 1024)
        fresh = <int32_t*> grow_buffer(NULL, new_cap * sizeof(int32_t))
        for slot in range(st.cap):
            if st.seqs[slot].status != SEQ_FREE:
                n = region_size(&st.seqs[slot])
                memcpy(fresh + off, st.arena + st.seqs[slot].region_off, n * sizeof(int32_t))
                st.seqs[slot].region_off = off
                off += n
        PyMem_Free(st.arena)
        st.arena, st.arena_cap, st.arena_used = fresh, new_cap, off
    off = st.arena_used
    st.arena_used += size
    st.arena_live += size
    return off


cdef inline int32_t store_new_slot(SlotStore* st, int64_t seq_id, int64_t num_stop,
                                   int64_t cap_tokens) except -1:
    """Take a slot (status WAITING, everything else zero) with a fresh arena region."""
    cdef int64_t off = store_arena_alloc(st, num_stop + cap_tokens)
    if st.num_free == 0:
        store_grow(st)
    st.num_free -= 1
    cdef int32_t slot = st.free_slots[st.num_free]
    cdef SeqState* s = &st.seqs[slot]
    s.seq_id, s.status, s.region_off = seq_id, SEQ_WAITING, off
    s.num_stop, s.cap_tokens = <int32_t> num_stop, <int32_t> cap_tokens
    s.num_tokens = s.num_computed = s.num_scheduled = s.num_blocks = s.num_spec = 0
    s.num_prompt_tokens = s.max_tokens = s.num_hashed = 0
    s.num_samples, s.last_hash, s.skip_cache, s.hash_root = 1, 0, 0, 0
    return slot


cdef inline void store_release(SlotStore* st, int32_t slot) noexcept nogil:
    """Return ``slot`` (its blocks already freed, table row all -1) and its arena region."""
    st.arena_live -= region_size(&st.seqs[slot])
    if st.arena_live == 0:
        st.arena_used = 0
    st.seqs[slot].status = SEQ_FREE
    st.free_slots[st.num_free] = slot
    st.num_free += 1


cdef inline void store_clone(SlotStore* st, int32_t parent, int32_t child) noexcept nogil:
    """Make ``child`` (fresh slot, same region size) a copy of ``parent`` after the in-flight
    step: same tokens, stop ids and limits, ``num_computed`` advanced by the scheduled tokens.
    The block table is the caller's (it must incref what it shares)."""
    cdef SeqState* p = &st.seqs[parent]
    cdef SeqState* c = &st.seqs[child]
    c.num_prompt_tokens, c.num_tokens = p.num_prompt_tokens, p.num_tokens
    c.max_tokens = p.max_tokens
    c.num_computed = p.num_computed + p.num_scheduled
    c.num_hashed, c.last_hash, c.skip_cache = p.num_hashed, p.last_hash, p.skip_cache
    c.hash_root = p.hash_root
    memcpy(st.arena + c.region_off, st.arena + p.region_off,
           (p.num_stop + p.num_tokens) * sizeof(int32_t))


cdef inline void store_dealloc(SlotStore* st) noexcept:
    """Free every buffer of the store."""
    PyMem_Free(st.seqs)
    PyMem_Free(st.free_slots)
    PyMem_Free(st.tables)
    PyMem_Free(st.running)
    PyMem_Free(st.waiting)
    PyMem_Free(st.arena)
