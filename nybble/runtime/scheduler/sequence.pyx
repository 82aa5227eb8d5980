# cython: language_level=3
"""The Python face of sequence.pxd: :class:`FinishReason`, the scheduler's finish codes.

``FinishReason`` is a ``cpdef enum`` declared once in sequence.pxd, so the Cython core
(``Scheduler.update``/``finish``, ``append_token``) and Python (the engine,
``nybble.runtime.frontend.request``) share one definition; here it is an :class:`enum.IntEnum` with
members NONE = 0 (running), STOPPED = 1, LENGTH = 2, ABORTED = 3. No torch is imported.
"""
