"""KV-cache allocation (PagedAttention pool; Kwon et al., SOSP 2023).

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: index 0 keys,
1 values. What the pool is (its :class:`~nybble.runtime.worker.kv_plan.KVCacheSpec`: blocks,
storage dtype) is planned by :func:`nybble.runtime.worker.kv_plan.plan_kv_cache`, with the
byte arithmetic shared with ``nybble plan``.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch

from nybble.runtime.worker.kv_plan import KVCacheSpec


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

    NOTE: zeroed, not empty: masked-out slots are multiplied by a zero probability, and
    uninitialised memory may hold NaN (0 * NaN = NaN). On CPU each tensor is an anonymous
    ``mmap`` (not ``malloc``, which the CPU runner tells to reuse freed heap memory): the OS
    maps its zero pages lazily, so start-up does not touch the whole pool, resident memory
    grows with the blocks actually written, and freeing the cache returns it to the OS.

    Raises:
        ValueError: the allocation failed for lack of memory (one line, naming the bytes).
    """
    shape = (2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    try:
        if device.type == "cpu":
            nbytes = spec.total_bytes // spec.num_layers
            # NOTE: bytes viewed as the storage dtype: numpy has no float8/bfloat16
            return [torch.from_numpy(np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8))
                    .view(spec.dtype).view(shape) for _ in range(spec.num_layers)]
        return [torch.zeros(shape, dtype=spec.dtype, device=device)
                for _ in range(spec.num_layers)]
    except (MemoryError, OSError, torch.OutOfMemoryError) as e:  # NOTE: one line for the user
        raise ValueError(f"the KV cache ({spec.num_blocks} blocks, {spec.total_bytes} bytes) "
                         f"must fit in memory, but allocating it on {device} failed; lower "
                         f"--num-gpu-blocks or --kv-cache-memory") from e
