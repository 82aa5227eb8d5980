"""The executor factory: the tensor-parallel executor the configuration names.

Apart from the executors' modules so that each executor's module imports only the base it
extends (:mod:`nybble.runtime.executor.tp_executor`), never its siblings.
"""
from __future__ import annotations

from nybble.config import EngineConfig
from nybble.runtime.executor.tp_executor import Executor, MPExecutor


def start_executor(config: EngineConfig) -> Executor:
    """The executor ``config.parallel_config.distributed_executor_backend`` names: ``ray``
    (:class:`~nybble.runtime.executor.ray_executor.RayExecutor`, imported only then) or
    ``mp`` (:class:`~nybble.runtime.executor.tp_executor.MPExecutor`), started (its workers
    load their shards while the caller goes on)."""
    if config.parallel_config.distributed_executor_backend == "ray":
        from nybble.runtime.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    return MPExecutor(config)
