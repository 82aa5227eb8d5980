"""The tensor-parallel group: rank, world size and the three collectives the model needs.

Megatron-LM (Shoeybi et al., 2019) sharding needs an all-reduce after every row-parallel
projection (and after the vocabulary-parallel embedding), and a gather of the
vocabulary-parallel logits to rank 0, which samples. Every collective runs on the default
``torch.distributed`` process group with the timeout given at start-up, so a dead rank turns
into an exception on the others rather than a hang.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
"""Seconds a collective waits for the other ranks before it raises."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: 0 .. ``world_size - 1``; rank 0 runs the scheduler and samples.
        world_size: ranks in the group (the ``tensor_parallel_size``).
        device: where collectives' tensors live (``cpu`` for gloo, the rank's GPU for NCCL).
        store: the rendezvous ``torch.distributed.Store`` (the command channel's headers go
            through it, see :mod:`nybble.distributed.channel`); ``None`` for one rank.
        counter: ``[n]``, the number of commands sent (rank 0) or received (others).
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    store: Any = field(default=None, compare=False, repr=False)
    counter: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @property
    def is_driver(self) -> bool:
        """Whether this is rank 0 (the scheduler's process)."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape and float dtype) over the ranks, in place; returns ``x``.
        The identity for one rank."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x [..., n]`` (same shape on all ranks) along the last
        dimension, in rank order, on rank 0: ``[..., world_size * n]``; ``None`` on the other
        ranks. ``x`` itself for one rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver \
            else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere), in
        place; returns ``x``."""
        if self.world_size > 1:
            dist.broadcast(x, src=0)
        return x


def single_rank() -> TPGroup:
    """The group of an unsharded model (rank 0 of 1: every collective is the identity)."""
    return TPGroup()


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the ``world_size``-rank group as ``rank`` (every rank calls this; it returns when
    all have joined).

    Args:
        init_method: the rendezvous, e.g. ``tcp://127.0.0.1:29500`` (rank 0 listens there).
        device: ``cpu`` (gloo backend) or a CUDA device (NCCL; this rank's GPU).
        timeout_s: seconds the rendezvous and every later collective may wait.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)`` or a device that is neither.
        ValueError: ``init_method`` is not ``tcp://host:port``.
        RuntimeError / DistStoreError: the other ranks did not join within ``timeout_s``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu (gloo) or cuda (nccl), got {device}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return TPGroup(0, 1, device)
    if not init_method.startswith("tcp://"):
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return TPGroup(rank, world_size, device, store)


def destroy_tp_group() -> None:
    """Leave the process group (after the last collective); a no-op if none was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
