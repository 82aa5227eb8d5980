"""The ``ray`` executor: tensor-parallel workers (ranks 1..N-1) as Ray actors.

The actors are placed by a placement group, one bundle per worker (``{"CPU": 1}``, plus
``{"GPU": 1}`` on CUDA; ``PACK`` strategy: on as few nodes as fit). Rank 0 stays in the
engine-core process (the driver), which must run on a node of the cluster. ``RAY_ADDRESS``
names an existing cluster (``ray start --head`` / ``ray start --address=...``); without it a
local cluster is started on loopback. The actors run the same command loop as ``mp`` workers
(:func:`nybble.runtime.executor.tp_worker.run_worker`); the group rendezvous on the driver's
address.
Ray ends the actors when the driver's process ends.
"""
from __future__ import annotations

import logging
import os

from nybble.config import EngineConfig, encode_config
from nybble.runtime.executor.tp_executor import STOP_WAIT_S, Executor, free_port
from nybble.runtime.executor.tp_worker import wants_cuda

logger = logging.getLogger(__name__)


class RayWorker:
    """The actor class (made remote by :class:`RayExecutor`): one worker rank."""

    def run(self, config_json: str, rank: int, init_method: str, cuda: bool) -> int:
        """Join the group, load the shard and follow commands until ``STOP``; returns the
        rank. A Ray actor sees only its own GPU: ``cuda:0``."""
        from nybble.config import decode_config
        from nybble.runtime.executor.tp_worker import run_worker

        run_worker(decode_config(config_json), rank, init_method, lambda: True,
                   gpu=0 if cuda else None)
        return rank


class RayExecutor(Executor):
    """Workers as Ray actors (``--distributed-executor-backend ray``).

    Raises (constructor):
        ImportError: Ray is not installed (``pip install 'nybble[ray]'``).
        WorkerFailedError: an actor failed before the group was complete, or the rendezvous
            or the placement timed out (``distributed_timeout_s``).
    """

    def __init__(self, config: EngineConfig) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as e:
            raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install "
                              "'nybble[ray]'") from e
        super().__init__()
        self._ray = ray
        n = config.parallel_config.tensor_parallel_size
        timeout = config.parallel_config.distributed_timeout_s
        self._started_ray = not ray.is_initialized()
        address = os.environ.get("RAY_ADDRESS")
        if self._started_ray:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:   # NOTE: a local cluster on loopback
                ray.init(address="local", include_dashboard=False, log_to_driver=False,
                         _node_ip_address="127.0.0.1")
        host = "127.0.0.1" if not address else ray.util.get_node_ip_address()
        cuda = wants_cuda(config)
        bundle = {"CPU": 1.0, "GPU": 1.0} if cuda else {"CPU": 1.0}
        self.pg = placement_group([dict(bundle) for _ in range(1, n)], strategy="PACK")
        self.actors: list = []
        self.runs: list = []
        if not self.pg.wait(timeout):
            self._stop_workers()
            self._closed = True
            raise RuntimeError(f"the Ray cluster must have room for {n - 1} worker(s) of "
                               f"{bundle}, but the placement group was not ready within "
                               f"{timeout:g} s")
        actor = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(RayWorker)
        init_method = f"tcp://{host}:{free_port(host)}"
        for r in range(1, n):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=r - 1)
            self.actors.append(actor.options(scheduling_strategy=strategy).remote())
            self.runs.append(self.actors[-1].run.remote(encode_config(config), r, init_method,
                                                        cuda))
        self._join(config, init_method)
        logger.info("tensor parallelism: %d ranks (ray executor, %s cluster)", n,
                    address or "local")

    def dead_workers(self) -> list[str]:
        if not self.runs:
            return []
        done, _ = self._ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        lines = []
        for r, ref in enumerate(self.runs, 1):
            if ref in done:
                try:
                    self._ray.get(ref, timeout=0)
                    lines.append(f"rank {r} (Ray actor) returned")
                except Exception as e:  # noqa: BLE001 -- reported, not raised
                    lines.append(f"rank {r} (Ray actor) failed: {str(e).splitlines()[0]}")
        return lines

    def _stop_workers(self) -> None:
        ray = self._ray
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_WAIT_S)
        for a in self.actors:
            ray.kill(a)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        if self._started_ray:
            ray.shutdown()
