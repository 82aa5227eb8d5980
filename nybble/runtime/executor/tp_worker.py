"""A tensor-parallel worker (ranks 1..N-1): load this rank's shard, then follow rank 0's
commands until told to stop or rank 0's process is gone.

Each step it receives the step's arrays (:mod:`nybble.runtime.executor.step_payload`), runs the same
forward as rank 0 over its own shard of the paged KV cache (same block count, same block
tables; its share of the KV heads), and takes part in the logits rank 0 asks for. It never
samples. With LoRA on it holds its share of every adapter slot
(:class:`nybble.models.lora.LoRASlots`), filled when rank 0 says so (``LORA``: it reads the
adapter folder itself), and each step's payload carries the rows' slots. Started by :mod:`nybble.runtime.executor.tp_executor` (a spawned process, or a Ray actor).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from nybble.config import EngineConfig, decode_config
from nybble.distributed import channel
from nybble.distributed.comm import TPGroup, destroy_tp_group, init_tp_group
from nybble.kernels import get_attention_backend
from nybble.lora_files import read_adapter
from nybble.models.lora import load_adapter_weights
from nybble.models.loader import LoadedModel, load_model
from nybble.oslimits import die_with_parent
from nybble.runtime.scheduler.scheduler_input import pool_tokens
from nybble.runtime.worker.kv_plan import (KVCacheSpec, fit_max_model_len,
                                           model_kv_storage_dtype, scheduler_window)
from nybble.runtime.worker.model_runner import ModelRunner
from nybble.runtime.executor.step_payload import unpack_step

logger = logging.getLogger(__name__)


def wants_cuda(config: EngineConfig) -> bool:
    """Whether the model runs on CUDA (``device`` cuda, or auto with a GPU visible)."""
    name = config.model_config.device
    return name == "cuda" or (name == "auto" and torch.cuda.is_available())


def rank_device(config: EngineConfig, rank: int, gpu: int | None = None) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<gpu>`` (default ``cuda:<rank>``: one machine) on
    CUDA, else the CPU.

    Raises:
        ValueError: CUDA asked for, but fewer GPUs than ``tensor_parallel_size``.
    """
    if not wants_cuda(config):
        return torch.device("cpu")
    if gpu is not None:     # a Ray actor sees only its own GPU
        return torch.device("cuda", gpu)
    n = config.parallel_config.tensor_parallel_size
    if torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size must be <= the {torch.cuda.device_count()} "
                         f"visible GPUs, got {n}")
    return torch.device("cuda", rank)


class TPWorker:
    """One worker rank: its model shard, KV cache shard and command loop.

    Args:
        config: the engine's configuration (the same object rank 0 uses).
        tp: this rank's group (already joined).
    """

    def __init__(self, config: EngineConfig, tp: TPGroup) -> None:
        self.config, self.tp = config, tp
        backend = get_attention_backend(config.attention_backend, tp.device)
        self.loaded: LoadedModel = load_model(config.model_config, backend, tp.device, tp)
        lc = config.lora_config
        if lc.enable_lora:
            self.loaded.model.enable_lora(lc.max_loras, lc.max_lora_rank)
        self.runner: ModelRunner | None = None

    def _load_lora(self, slot: int, path: str) -> None:
        """Put this rank's share of the adapter folder ``path`` into LoRA slot ``slot``.

        Raises:
            LoRAAdapterError: the folder cannot be read here (rank 0 read it: the worker
                then stops, and the engine reports the failed worker).
        """
        model = self.loaded.model
        assert model.lora is not None, "a LORA command needs enable_lora"
        spec = read_adapter(path, model.lora_targets(), model.lora.max_rank)
        model.lora.write(slot, load_adapter_weights(spec, model.lora.dtype))

    def _setup(self, num_blocks: int) -> None:
        """Allocate this rank's KV-cache shard: rank 0's block count, this rank's heads."""
        shape = self.loaded.shard_shape
        cc = self.config.cache_config
        spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                           model_kv_storage_dtype(cc.kv_cache_dtype, self.loaded.dtype,
                                                  self.loaded.cpu_activations),
                           cc.block_size, num_blocks)
        # NOTE: rank 0's rule on the same numbers, so the block tables have one width
        pool = pool_tokens(num_blocks, cc.block_size, scheduler_window(self.loaded, self.config),
                           self.config.scheduler_config.max_num_batched_tokens)
        fitted = fit_max_model_len(pool, self.loaded.max_model_len,
                                   self.config.model_config.max_model_len is not None)
        self.loaded = dataclasses.replace(self.loaded, max_model_len=fitted)
        self.runner = ModelRunner(self.loaded, spec, self.tp.device, self.config)

    @torch.inference_mode()
    def run(self, keep_waiting: Callable[[], bool]) -> None:
        """Follow commands until ``STOP`` (or ``keep_waiting()`` says rank 0 is gone)."""
        hidden_size = self.loaded.shape.hidden_size
        while (cmd := channel.receive(self.tp, keep_waiting)) is not None:
            if cmd.kind == channel.Kind.STOP:
                return
            if cmd.kind == channel.Kind.SETUP:
                self._setup(cmd.ints[0])
                self.tp.all_reduce(torch.ones(1, device=self.tp.device))  # "ready"
            elif cmd.kind == channel.Kind.STEP:
                assert self.runner is not None and cmd.payload is not None
                self.runner.forward(*unpack_step(cmd.ints, cmd.payload))
            elif cmd.kind == channel.Kind.LORA:
                assert cmd.payload is not None
                path = cmd.payload.cpu().numpy().astype(np.uint8).tobytes().decode()
                self._load_lora(cmd.ints[0], path)
            elif cmd.kind == channel.Kind.LOGITS:
                assert cmd.payload is not None
                self.loaded.model.worker_logits(cmd.payload.view(-1, hidden_size))
        logger.warning("tensor-parallel rank %d: rank 0 is gone; exiting", self.tp.rank)


def run_worker(config: EngineConfig, rank: int, init_method: str,
               keep_waiting: Callable[[], bool], gpu: int | None = None) -> None:
    """A worker's whole life: join the group, load, serve commands, leave (``gpu``: see
    :func:`rank_device`)."""
    from nybble.runtime.worker.torch_threads import setup_threads

    setup_threads(config.threads)
    tp = init_tp_group(rank, config.parallel_config.tensor_parallel_size, init_method,
                       rank_device(config, rank, gpu),
                       config.parallel_config.distributed_timeout_s)
    try:
        TPWorker(config, tp).run(keep_waiting)
    finally:
        destroy_tp_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of an ``mp`` worker process (``python -m nybble.runtime.executor.tp_worker``):
    dies with its parent (``PR_SET_PDEATHSIG``, and a check every second while idle).
    Returns the exit code."""
    parser = argparse.ArgumentParser(prog="nybble.runtime.executor.tp_worker")
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="tcp://host:port of rank 0")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s")
    die_with_parent(args.parent_pid)
    run_worker(decode_config(args.config), args.rank, args.init_method,
               lambda: os.getppid() == args.parent_pid)
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)   # NOTE: skip torch's slow interpreter teardown
