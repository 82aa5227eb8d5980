"""Starting the engine-core process: the first thing ``nybble serve`` does once its flags are
checked and its port is bound.

The core spends most of its start-up importing torch, so every millisecond the API process
spends before the spawn is added to the time to the first answer. This module therefore
imports only what the spawn needs (``subprocess``, ``tempfile``, the config codec: no asyncio,
ZeroMQ or web stack); :class:`~nybble.runtime.core_client.CoreClient` then binds the sockets the
core connects to (the core connects only after its torch import, long after they are bound).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from nybble.config import EngineConfig
from nybble.runtime.messages import encode_config


@dataclass(frozen=True)
class CoreProcess:
    """A started engine-core process and where it will connect.

    Attributes:
        proc: the ``python -m nybble.runtime.core_process`` child.
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
    folder = tempfile.mkdtemp(prefix="nybble-core-")
    in_addr, out_addr = f"ipc://{folder}/input", f"ipc://{folder}/output"
    cmd = [sys.executable, "-m", "nybble.runtime.core_process", "--input-address", in_addr,
           "--output-address", out_addr, "--parent-pid", str(os.getpid()),
           "--log-level", log_level, "--config", encode_config(config)]
    # NOTE: a session of its own: a terminal's Ctrl-C (or a signal to our process group)
    # reaches only the API process, which then shuts the core down in order
    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return CoreProcess(proc, folder, in_addr, out_addr)
