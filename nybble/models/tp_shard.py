"""Read a rank's part of a checkpoint tensor (tensor parallelism), from safetensors slices.

Each linear module declares, per checkpoint tensor name, its output axis (``output_dims``)
and input axis (``input_dims``; ``None``: not split along the input, e.g. a per-output-channel
scale), and which tensors hold one row per quantization group (``group_tensors``). The number
of logical features one entry covers along an axis follows from the tensor's size: 1 for
plain weights, the pack factor for packed ints (docs/quant-formats.md §3.1, §4.1, §6.2), the
group size for scales and zero points. A rank's feature range must fall on those boundaries;
otherwise loading stops with an error naming the layer and the sizes.

Row-parallel act-order layers (GPTQ ``g_idx``, compressed-tensors ``weight_g_idx``): the
shard's input channels may belong to any group, so ``g_idx`` is split with the channels and
the group tensors are kept whole (as vLLM does).
"""
from __future__ import annotations

from typing import Any

import torch

from nybble.errors import UnsupportedModelError
from nybble.models.tp_layout import ShardSlice

G_IDX_NAMES = ("g_idx", "weight_g_idx")


def is_act_order(g_idx: torch.Tensor, num_groups: int) -> bool:
    """Whether ``g_idx [K]`` differs from contiguous groups ``k // (K / num_groups)``."""
    k = g_idx.shape[0]
    if k % num_groups:
        return True
    return not torch.equal(g_idx.to(torch.int64), torch.arange(k) // (k // num_groups))


def read_shard(handle: Any, key: str, name: str, module: torch.nn.Module,
               sl: ShardSlice | None, rank: int, act_order: bool) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``key`` (tensor ``name`` of ``module``).

    Args:
        handle: an open ``safetensors.safe_open`` file.
        sl: the rank's slice of the projection (``None``: the whole tensor).
        act_order: the row-parallel layer has a non-trivial ``g_idx``.

    Raises:
        UnsupportedModelError: the slice does not fall on a packing or group boundary, or a
            tensor's size does not divide the projection's width.
    """
    if sl is None:
        return handle.get_tensor(key)
    if name == "weight_shape":      # compressed-tensors: [N, K] of the (sliced) shard
        n, k = handle.get_tensor(key).tolist()
        return torch.tensor([sl.length, k] if sl.axis == "out" else [n, sl.length])
    dims = module.output_dims if sl.axis == "out" else getattr(module, "input_dims", {})
    dim = dims.get(name, 0 if sl.axis == "out" else None)
    if dim is None:
        if sl.axis == "in" and name == "bias" and rank != 0:
            # NOTE: a row-parallel bias is added once, after the all-reduce: rank 0 holds it
            return torch.zeros_like(handle.get_tensor(key))
        return handle.get_tensor(key)
    part = handle.get_slice(key)
    shape = list(part.get_shape())
    size = shape[dim]
    grouped = name in getattr(module, "group_tensors", ())
    if sl.axis == "in" and grouped and (act_order or size == 1):
        return handle.get_tensor(key)   # every group (act order), or one group for all
    if sl.full % size:
        raise UnsupportedModelError(
            f"{key}: its dim {dim} ({size} entries) must divide the layer's {sl.full} "
            f"{'output' if sl.axis == 'out' else 'input'} features to be split for tensor "
            f"parallelism, got shape {shape}")
    per = sl.full // size
    if sl.start % per or sl.length % per:
        what = "group" if grouped and sl.axis == "in" else "packed entry"
        raise UnsupportedModelError(
            f"{key}: each {what} covers {per} features along dim {dim} (shape {shape}), but "
            f"this rank's {'output' if sl.axis == 'out' else 'input'} features "
            f"[{sl.start}, {sl.start + sl.length}) of {sl.full} do not start and end on such "
            f"a boundary; a tensor_parallel_size whose split is a multiple of {per} is "
            f"allowed")
    index = [slice(None)] * len(shape)
    index[dim] = slice(sl.start // per, (sl.start + sl.length) // per)
    t = part[tuple(index)]
    if sl.axis == "in" and name in G_IDX_NAMES and not act_order and t.numel():
        t = t - t[0]    # contiguous groups: the shard's first group becomes group 0
    return t


def read_vocab_rows(handle: Any, key: str, start: int, rows: int) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of an embedding / LM-head matrix ``[V, hidden]``, the
    rows past ``V`` zero (the padding of the last rank)."""
    part = handle.get_slice(key)
    vocab, hidden = part.get_shape()
    t = part[max(0, min(start, vocab)):min(start + rows, vocab)]
    if t.shape[0] == rows:
        return t
    out = torch.zeros(rows, hidden, dtype=t.dtype)
    out[:t.shape[0]] = t
    return out
