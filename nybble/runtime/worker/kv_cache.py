"""KV-cache sizing and allocation (PagedAttention pool; Kwon et al., SOSP 2023).

One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``: index 0 keys,
1 values. The byte arithmetic (bytes per block, blocks in a budget) is
:mod:`nybble.runtime.worker.kv_plan`'s, shared with ``nybble plan``.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

from nybble.config import CacheConfig
from nybble.models.shape import ModelShape
from nybble.runtime.worker.kv_plan import (
    KVLayout,
    blocks_in_budget,
    check_kv_cache_dtype,
    default_cpu_kv_budget,
    kv_budget_from_free,
)


_KV_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the pool stores: the model's for ``auto``, ``torch.int8`` or
    ``torch.float8_e4m3fn`` for the quantized caches.

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES`.
    """
    return _KV_STORAGE.get(check_kv_cache_dtype(kv_cache_dtype), model_dtype)


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds quantized values (read through per-head scales)."""
    return dtype in _KV_STORAGE.values()


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV pool derived at start-up.

    Attributes:
        num_layers, num_kv_heads, head_dim: the model's geometry (from its ``ModelShape``).
        dtype: storage dtype (the model's activation dtype, or ``int8`` /
            ``float8_e4m3fn`` for a quantized cache).
        block_size: tokens per block.
        num_blocks: blocks in the pool.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    num_blocks: int

    @property
    def layout(self) -> KVLayout:
        """The pool's byte geometry (:class:`nybble.runtime.worker.kv_plan.KVLayout`)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, elem,
                        self.block_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (keys and values)."""
        return self.layout.bytes_per_block

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.bytes_per_block * self.num_blocks


def plan_kv_cache(cache: CacheConfig, shape: ModelShape, dtype: torch.dtype,
                  device: torch.device, max_model_len: int | None = None) -> KVCacheSpec:
    """Turn ``--num-gpu-blocks`` or a byte budget into a :class:`KVCacheSpec`.

    Without either flag the budget on CPU is
    :func:`~nybble.runtime.worker.kv_plan.default_cpu_kv_budget` (256 MiB, grown to hold one sequence
    of ``max_model_len`` tokens within a quarter of the machine's memory), or
    :func:`~nybble.runtime.worker.kv_plan.kv_budget_from_free` of the free device memory (after the
    weights are loaded) on CUDA; blocks come from
    :func:`~nybble.runtime.worker.kv_plan.blocks_in_budget` (the functions ``nybble plan`` uses).
    ``cache.kv_cache_dtype`` picks the storage dtype (``dtype``, the model's, for ``auto``).

    Raises:
        ValueError: the budget is smaller than one block, or the pool (``num_gpu_blocks``
            blocks, or the ``kv_cache_memory`` budget) needs more bytes than the device has
            (:func:`_memory_limit`).
    """
    geometry = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
    spec = KVCacheSpec(*geometry, kv_storage_dtype(cache.kv_cache_dtype, dtype),
                       cache.block_size, 1)
    if cache.num_gpu_blocks is not None:
        num_blocks, flag = cache.num_gpu_blocks, "num_gpu_blocks"
    else:
        flag = "kv_cache_memory"
        budget = cache.kv_cache_memory
        if budget is None:
            if device.type == "cuda":
                budget = kv_budget_from_free(torch.cuda.mem_get_info(device)[0])
            else:
                budget = default_cpu_kv_budget(spec.layout, max_model_len or 1,
                                               _memory_limit(device)[0])
        num_blocks = blocks_in_budget(budget, spec.layout)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory must hold at least one block "
                             f"({spec.bytes_per_block} bytes), got {budget} bytes")
    need, (have, where) = num_blocks * spec.bytes_per_block, _memory_limit(device)
    if need > have:
        raise ValueError(f"{flag} must fit in memory: {num_blocks} blocks x "
                         f"{spec.bytes_per_block} bytes = {need} bytes of KV cache, but "
                         f"{where} is {have} bytes (at most {have // spec.bytes_per_block} "
                         f"blocks)")
    return KVCacheSpec(*geometry, spec.dtype, cache.block_size, num_blocks)


def _memory_limit(device: torch.device) -> tuple[int, str]:
    """``(bytes, what)``: the most a KV pool on ``device`` can take -- the free memory of a
    GPU (after the weights), or the machine's physical memory on the CPU (the pool's pages
    are mapped lazily, so free memory at start-up is not the limit)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"the free memory of {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"


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
