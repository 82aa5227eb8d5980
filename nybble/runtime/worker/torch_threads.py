"""Apply the ``--threads`` setting to torch and nybble's C kernels in the process that runs
the model (see :mod:`nybble.threads` for the rule and why)."""
from __future__ import annotations

import logging
import os

from nybble.threads import WAIT_POLICY_ENV, resolve_threads, set_thread_env

logger = logging.getLogger(__name__)


_applied: list[int] = []   # the value last applied in this process


def apply_torch_threads(threads: int, source: str) -> None:
    """Set torch's intra-op threads (imports torch) and nybble's C kernels' pools to
    ``threads``; log the setting when it changes."""
    import torch

    from nybble.kernels.cpu.threads import set_kernel_threads

    torch.set_num_threads(threads)
    set_kernel_threads(threads)
    if _applied == [threads]:
        return
    _applied[:] = [threads]
    logger.info("torch intra-op threads: %d (%s; %s=%s)", threads, source, WAIT_POLICY_ENV,
                os.environ.get(WAIT_POLICY_ENV, "unset"))


def setup_threads(requested: int | None) -> int:
    """Resolve, export and apply the thread setting for a process that runs the model.

    Returns:
        The number of intra-op threads.
    """
    threads, source = resolve_threads(requested)
    set_thread_env(threads)
    apply_torch_threads(threads, source)
    return threads
