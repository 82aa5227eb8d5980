"""Executors of tensor parallelism: start ranks 1..N-1, join the group as rank 0, send each
step to the workers, and stop them.

``mp`` (:class:`MPExecutor`): spawned worker processes on this machine, the rendezvous on
loopback. ``ray`` (:mod:`nybble.runtime.executor.ray_executor`): Ray actors. Either way rank 0 (the
engine core) keeps its own runner in-process; the workers follow the command channel
(:mod:`nybble.distributed.channel`).
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import torch

from nybble.config import EngineConfig, encode_config
from nybble.distributed import channel
from nybble.distributed.comm import TPGroup, destroy_tp_group, init_tp_group
from nybble.errors import WorkerFailedError
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.executor.step_payload import pack_step
from nybble.runtime.executor.tp_worker import rank_device

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""Seconds :meth:`Executor.shutdown` waits for each worker to exit before killing it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the rendezvous port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Executor:
    """Rank 0's side of the group; subclasses start and watch the workers.

    Attributes:
        tp: rank 0's :class:`TPGroup` (set by the subclass once the group is joined).
    """

    tp: TPGroup

    def __init__(self) -> None:
        self._closed = False
        atexit.register(self.shutdown)

    def dead_workers(self) -> list[str]:
        """One line per worker that is gone (empty: all alive)."""
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError

    def check_workers(self) -> None:
        """Raises:
            WorkerFailedError: a worker is gone."""
        dead = self.dead_workers()
        if dead:
            raise WorkerFailedError(f"tensor-parallel worker failed: {'; '.join(dead)}")

    def _join(self, config: EngineConfig, init_method: str) -> None:
        """Join the group as rank 0 (sets :attr:`tp`), watching the workers meanwhile.

        Raises:
            WorkerFailedError: a worker died first, or the rendezvous timed out (the
                workers are stopped then).
        """
        joined: list[TPGroup | BaseException] = []

        def join() -> None:
            try:
                joined.append(init_tp_group(0, config.parallel_config.tensor_parallel_size,
                                            init_method, rank_device(config, 0),
                                            config.parallel_config.distributed_timeout_s))
            except BaseException as e:  # noqa: BLE001 -- handed to the main thread
                joined.append(e)
        thread = threading.Thread(target=join, name="nybble-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive() and not self.dead_workers():
            thread.join(0.1)    # NOTE: a worker that dies early fails the start-up at once
        if not joined or not isinstance(joined[0], TPGroup):
            self._closed = True
            atexit.unregister(self.shutdown)
            dead = self.dead_workers()
            self._stop_workers()
            cause = joined[0] if joined else None
            raise WorkerFailedError(f"tensor-parallel start-up failed: "
                                    f"{'; '.join(dead) or cause}") from cause
        self.tp = joined[0]

    def setup(self, num_blocks: int) -> None:
        """Tell the workers the KV pool's block count; returns once every worker has loaded
        its shard and allocated its KV cache (an all-reduce of one flag).

        Raises:
            WorkerFailedError: a worker failed to load or allocate, or did not answer
                within ``distributed_timeout_s``.
        """
        channel.send(self.tp, channel.Kind.SETUP, [num_blocks])
        try:
            ready = self.tp.all_reduce(torch.ones(1, device=self.tp.device))
        except Exception as e:
            raise WorkerFailedError(f"tensor-parallel workers did not start: "
                                    f"{'; '.join(self.dead_workers()) or e}") from e
        if int(ready.item()) != self.tp.world_size:
            raise WorkerFailedError(f"{self.tp.world_size - int(ready.item())} "
                                    f"tensor-parallel worker(s) failed to start")

    def send_step(self, batch: ScheduledBatch, token_slots: torch.Tensor | None = None) -> None:
        """Send ``batch``'s arrays, and the LoRA slot of each row (``[T]`` int64, or None),
        to the workers (before rank 0's own forward).

        Raises:
            WorkerFailedError: a worker is gone (checked first, so no collective waits
                on it).
        """
        self.check_workers()
        ints, payload = pack_step(batch, token_slots)
        channel.send(self.tp, channel.Kind.STEP, ints, payload)

    def send_lora(self, slot: int, path: str) -> None:
        """Have every worker load its share of the adapter folder ``path`` into LoRA slot
        ``slot`` (rank 0 has read and checked the folder already; the workers read it
        from the same path, before the next step).

        Raises:
            WorkerFailedError: a worker is gone.
        """
        self.check_workers()
        data = np.frombuffer(path.encode(), np.uint8).astype(np.int64)
        channel.send(self.tp, channel.Kind.LORA, [slot], torch.from_numpy(data))

    def shutdown(self) -> None:
        """Stop the workers (``STOP``, then kill after :data:`STOP_WAIT_S`) and leave the
        group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            if not self.dead_workers():
                channel.send(self.tp, channel.Kind.STOP)
        except Exception as e:  # noqa: BLE001 -- shutting down anyway
            logger.warning("could not send STOP to the workers: %s", e)
        self._stop_workers()
        destroy_tp_group()


class MPExecutor(Executor):
    """Workers as processes on this machine (``--distributed-executor-backend mp``), each
    ``python -m nybble.runtime.executor.tp_worker`` (a fresh interpreter: the caller's script is not
    re-imported, so no ``if __name__ == "__main__"`` guard is needed).

    Raises (constructor):
        WorkerFailedError: a worker exited before the group was complete, or the rendezvous
            timed out (``distributed_timeout_s``).
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        n = config.parallel_config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        args = [sys.executable, "-m", "nybble.runtime.executor.tp_worker", "--config",
                encode_config(config), "--init-method", init_method,
                "--parent-pid", str(os.getpid())]
        self.procs: list[subprocess.Popen] = []
        for r in range(1, n):
            self.procs.append(subprocess.Popen([*args, "--rank", str(r)]))
        self._join(config, init_method)
        logger.info("tensor parallelism: %d ranks (mp executor, workers %s)", n,
                    [p.pid for p in self.procs])

    def dead_workers(self) -> list[str]:
        return [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in enumerate(self.procs, 1) if p.poll() is not None]

    def _stop_workers(self) -> None:
        for p in self.procs:
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_WAIT_S)
