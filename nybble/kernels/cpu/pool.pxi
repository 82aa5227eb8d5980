# The module's thread pool (pool.h): each extension module that includes this has its own.
cdef extern from "pool.h" nogil:
    int nyb_pool_set_threads(int threads)
    int nyb_pool_threads()


def set_threads(int threads) -> int:
    """Run this module's kernels on ``threads`` threads (the caller and ``threads - 1`` pool
    workers, pool.h: chunks claimed from one counter, so a worker without a core holds
    nothing up); clamped to [1, 64].

    Returns:
        The thread count in use (fewer than asked when a worker could not be started).
    """
    with nogil:
        threads = nyb_pool_set_threads(threads)
    return threads


def get_threads() -> int:
    """The thread count this module's kernels use (1 until :func:`set_threads`)."""
    return nyb_pool_threads()
