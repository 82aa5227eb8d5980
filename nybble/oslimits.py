"""Process resource limits (POSIX ``resource``): the open-file limit for many sockets."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


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
