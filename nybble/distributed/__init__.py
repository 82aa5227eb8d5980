"""Tensor-parallel communication on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

A floor below ``nybble.models``: the sharded layers call :class:`TPGroup`'s collectives, the
runtime's executors start the ranks and drive the per-step command channel.
"""
from nybble.distributed.comm import TPGroup, init_tp_group, single_rank

__all__ = ["TPGroup", "init_tp_group", "single_rank"]
