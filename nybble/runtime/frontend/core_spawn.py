"""Starting the engine-core process: the first thing ``nybble serve`` does once its flags are
checked and its port is bound.

The core spends most of its start-up importing torch, so every millisecond the API process
spends before the spawn is added to the time to the first answer. This module therefore
imports only what the spawn needs (``subprocess``, ``tempfile``, the config codec: no asyncio,
ZeroMQ or web stack); :class:`~nybble.runtime.frontend.core_client.CoreClient` then binds the
sockets the core connects to (the core connects only after its torch import, long after they
are bound).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from nybble.config import EngineConfig, encode_config

FOLDER_PREFIX = "nybble-core-"
OWNER_FILE = "owner.pid"
"""In each socket folder: the pid of the API process that made it (see
:func:`sweep_stale_folders`)."""


@dataclass(frozen=True)
class CoreProcess:
    """A started engine-core process and where it will connect.

    Attributes:
        proc: the ``python -m nybble.runtime.engine.core_process`` child.
        folder: the private temporary folder of the two Unix-domain sockets (removed by
            :meth:`CoreClient.close`).
        input_address: ZeroMQ address the core pulls its inputs from (``ipc://...``).
        output_address: ZeroMQ address the core pushes its outputs to (``ipc://...``).
    """

    proc: subprocess.Popen
    folder: str
    input_address: str
    output_address: str


def spawn_core(config: EngineConfig, log_level: str = "INFO") -> CoreProcess:
    """Start the engine-core process for ``config``; returns at once (it loads in the
    background and answers with its handshake on ``output_address``).

    NOTE: call it on the main thread: Linux's parent-death signal of the core follows the
    thread that started it.

    Raises:
        OSError: the process could not be started.
    """
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    with open(os.path.join(folder, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    in_addr, out_addr = f"ipc://{folder}/input", f"ipc://{folder}/output"
    cmd = [sys.executable, "-m", "nybble.runtime.engine.core_process", "--input-address", in_addr,
           "--output-address", out_addr, "--parent-pid", str(os.getpid()),
           "--log-level", log_level, "--config", encode_config(config)]
    # NOTE: a session of its own: a terminal's Ctrl-C (or a signal to our process group)
    # reaches only the API process, which then shuts the core down in order
    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    sweep_stale_folders()   # NOTE: after the spawn, while the core imports torch
    return CoreProcess(proc, folder, in_addr, out_addr)


def sweep_stale_folders() -> list[str]:
    """Remove the socket folders that earlier ``nybble serve`` processes could not (killed by
    SIGKILL, their core with them): a folder in the temporary directory whose
    :data:`OWNER_FILE` names a process that no longer exists. Folders of live processes, of
    other users (unreadable) and without an owner file are left alone. Returns the removed
    paths."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), FOLDER_PREFIX + "*")):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        if pid > 0 and not _process_exists(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True
