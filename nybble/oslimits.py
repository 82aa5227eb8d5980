"""Process-level OS helpers: resource limits (POSIX ``resource``: the open-file limit for many
sockets) and tying a child process's life to its parent (Linux ``prctl``)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def raise_open_file_limit(wanted: int) -> int:
    """Raise this process's soft open-file limit toward ``wanted`` (at most the hard limit),
    so that many connections can be open at once (a common soft limit is 1024).

    Returns:
        The soft limit now (``wanted`` where it could not be read: not POSIX).
    """
    try:
        import resource
    except ImportError:  # NOTE: not POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return int(soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
        return int(soft)
    return int(target)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent exits; exit now if it already has.

    NOTE: the signal fires when the parent *thread* that spawned us exits: the client spawns
    from the main thread. Elsewhere than Linux only the loop's parent check applies.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
