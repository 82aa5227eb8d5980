"""KV-pool planning: the arithmetic shared by the engine's start-up and ``nybble plan``, and
the engine's plan itself (:func:`plan_kv_cache` -> :class:`KVCacheSpec`).

One implementation: :func:`plan_kv_cache` sizes the engine's pool with these functions, and the
planner (:mod:`nybble.plan.planner`) calls the same ones with the memory figures the user
gives, so the two agree to the block. The module imports no torch: the functions that take or
return torch objects (dtypes, devices) import it when called. The pool's tensors are allocated
by :mod:`nybble.runtime.worker.kv_cache`.

A block holds ``block_size`` tokens of every layer (PagedAttention, Kwon et al., SOSP 2023):
``bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes``
(keys and values). Quantized caches (``int8``, ``fp8_e4m3``) store one byte per element plus
one float32 scale per layer, K/V and KV head (:mod:`nybble.runtime.worker.kv_calibration`); the
scales are a fixed ``8 * num_layers * num_kv_heads`` bytes, outside the blocks.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nybble.config import KV_CACHE_DTYPES, CacheConfig

if TYPE_CHECKING:
    import torch

    from nybble.models.shape import ModelShape

logger = logging.getLogger(__name__)

GPU_MEMORY_FRACTION = 0.9
"""Share of the free device memory (after the weights) the KV pool takes on a GPU."""

_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "int8": 1}


def check_kv_cache_dtype(value: str) -> str:
    """``value`` if it is one of :data:`KV_CACHE_DTYPES`.

    Raises:
        ValueError: any other value (the message lists the allowed ones).
    """
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {value!r}")
    return value


def kv_element_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes of one cached element: the model dtype's (``float32``/``float16``/``bfloat16``)
    for ``auto``, 2 for ``bfloat16``, 4 for ``float32``, else 1.

    Raises:
        ValueError: an unknown ``kv_cache_dtype`` or model dtype.
    """
    name = model_dtype if check_kv_cache_dtype(kv_cache_dtype) == "auto" else kv_cache_dtype
    if name not in _ELEMENT_BYTES:
        raise ValueError(f"model dtype must be one of float32, float16, bfloat16, got "
                         f"{model_dtype!r}")
    return _ELEMENT_BYTES[name]


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads one tensor-parallel rank holds, as Megatron-LM shards attention: the heads are
    split evenly; with more ranks than heads each head is replicated on ``tp / Hkv`` ranks.

    Raises:
        ValueError: ``tensor_parallel_size`` < 1, or neither divides the other.
    """
    tp = tensor_parallel_size
    if tp < 1 or (num_kv_heads % tp and tp % num_kv_heads):
        raise ValueError(f"tensor_parallel_size must be >= 1 and divide, or be a multiple of, "
                         f"the model's {num_kv_heads} KV heads, got {tp}")
    return max(1, num_kv_heads // tp)


@dataclass(frozen=True)
class KVLayout:
    """The byte geometry of a KV pool (on one tensor-parallel rank).

    Attributes:
        num_layers, num_kv_heads, head_dim: the model's geometry (KV heads of this rank).
        element_bytes: bytes per cached element (:func:`kv_element_bytes`).
        block_size: tokens per block.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (keys and values)."""
        return self.bytes_per_token * self.block_size


def kv_budget_from_free(free_bytes: int) -> int:
    """The KV budget (bytes) the engine takes from ``free_bytes`` of device memory left after
    the weights: :data:`GPU_MEMORY_FRACTION` of it (the rest is activations' headroom)."""
    return int(max(free_bytes, 0) * GPU_MEMORY_FRACTION)


def kv_budget_from_utilization(free_bytes: int, total_bytes: int, fraction: float) -> int:
    """The KV budget (bytes) under vLLM's ``--gpu-memory-utilization``: the engine may hold
    ``fraction`` of the device's ``total_bytes``, and what it holds already (``total - free``,
    the weights) comes off that; 0 when the weights alone take more."""
    return max(int(total_bytes * fraction) - (total_bytes - free_bytes), 0)


def blocks_in_budget(budget_bytes: int, layout: KVLayout) -> int:
    """Whole blocks of ``layout`` in ``budget_bytes`` (may be 0: callers decide)."""
    return max(budget_bytes, 0) // layout.bytes_per_block


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``num_tokens`` tokens occupies (the last one partly)."""
    return -(-num_tokens // block_size)


DEFAULT_CPU_KV_BYTES = 256 << 20
"""The CPU KV budget's floor when neither ``--kv-cache-memory`` nor ``--num-gpu-blocks`` is set
(bytes)."""

CPU_KV_MEMORY_FRACTION = 0.25
"""The most of the machine's physical memory the default CPU KV budget grows to, so that one
sequence of ``max_model_len`` tokens fits (the pool's pages are mapped lazily)."""


def default_cpu_kv_budget(layout: KVLayout, max_model_len: int, physical_bytes: int) -> int:
    """The CPU KV budget (bytes) without a user-set size: at least
    :data:`DEFAULT_CPU_KV_BYTES`, grown to hold one whole sequence of ``max_model_len`` tokens
    but never past :data:`CPU_KV_MEMORY_FRACTION` of ``physical_bytes`` (then
    :func:`fit_max_model_len` lowers the length to what fits)."""
    one_sequence = blocks_per_sequence(max_model_len, layout.block_size) * layout.bytes_per_block
    cap = int(physical_bytes * CPU_KV_MEMORY_FRACTION)
    return max(DEFAULT_CPU_KV_BYTES, min(one_sequence, cap))


def scheduler_window(loaded: Any, config: Any) -> int | None:
    """The sliding window (tokens) out of which the scheduler frees KV blocks: the model's
    :attr:`~nybble.models.loader.LoadedModel.kv_free_window` (every layer windowed), but None
    with speculative decoding, whose draft model reads the target's block tables with its own
    (full) attention."""
    if config.speculative_config is not None:
        return None
    return loaded.kv_free_window


def fit_max_model_len(pool_tokens: int | None, max_model_len: int, user_set: bool) -> int:
    """The ``max_model_len`` the engine serves with a KV pool of ``pool_tokens`` slots
    (``None``: any length, a sliding window's blocks being freed as a sequence grows; see
    :func:`~nybble.runtime.scheduler.scheduler_input.pool_tokens`).

    A length the user did not set (the model's own limit) is lowered to the pool's tokens, so
    a request without ``max_tokens`` (the rest of the context) is never refused for a limit the
    user did not choose (llama.cpp's ``--fit``); a length the user set must fit (vLLM's rule).

    Raises:
        ValueError: ``user_set`` and one sequence of ``max_model_len`` tokens needs more than
            the pool's ``pool_tokens`` slots (the message names both and the flags to change).
    """
    if pool_tokens is None or pool_tokens >= max_model_len:
        return max_model_len
    if user_set:
        raise ValueError(f"max_model_len must fit in the KV cache: {max_model_len} tokens were "
                         f"asked for, but the pool holds {pool_tokens} tokens; lower "
                         f"--max-model-len to at most {pool_tokens} or raise "
                         f"--kv-cache-memory / --num-gpu-blocks")
    return pool_tokens


_KV_STORAGE = {"bfloat16": "bfloat16", "float32": "float32", "int8": "int8",
               "fp8_e4m3": "float8_e4m3fn"}
"""``kv_cache_dtype`` other than ``auto`` -> the name of the torch dtype the pool stores."""

_QUANTIZED_STORAGE = ("int8", "float8_e4m3fn")
"""The storage dtypes that hold quantized values (read through per-head scales)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           cpu_activations: str | None) -> str:
    """``auto`` resolved for a loaded model: ``bfloat16`` for a float32 model whose quantized
    matmuls run on the CPU with rounded activations (``cpu_activations`` ``int16`` / ``int8``
    / ``bfloat16``), else ``kv_cache_dtype`` as given (``auto``: the model's dtype).

    Why: that path already trades the last bits for speed, and a 2-byte cache costs
    -0.009% held-out perplexity on SmolLM2-135M (+0.000% on the bundled model) while a single
    stream's decode step runs ~20% faster with it (docs/kv-cache.md, benchmarks/README.md);
    the exact path (``cpu_activation_dtype`` float32) and dense models keep the model's
    dtype, so their outputs stay the reference's. vLLM's CPU backend runs bfloat16 by default
    for the same reason.

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES`.
    """
    import torch

    if (check_kv_cache_dtype(kv_cache_dtype) == "auto" and model_dtype == torch.float32
            and cpu_activations in ("int16", "int8", "bfloat16")):
        return "bfloat16"
    return kv_cache_dtype


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the pool stores: the model's for ``auto``, ``torch.bfloat16``,
    ``torch.int8`` or ``torch.float8_e4m3fn`` for the others.

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES`.
    """
    name = _KV_STORAGE.get(check_kv_cache_dtype(kv_cache_dtype))
    if name is None:
        return model_dtype
    import torch

    return getattr(torch, name)


def model_kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           cpu_activations: str | None) -> torch.dtype:
    """The torch dtype a loaded model's pool stores for ``kv_cache_dtype``:
    :func:`resolve_kv_cache_dtype`, then :func:`kv_storage_dtype`."""
    return kv_storage_dtype(resolve_kv_cache_dtype(kv_cache_dtype, model_dtype,
                                                   cpu_activations), model_dtype)


def is_quantized_kv(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds quantized values (read through per-head scales)."""
    import torch

    return dtype in (getattr(torch, name) for name in _QUANTIZED_STORAGE)


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
        """The pool's byte geometry (:class:`KVLayout`)."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype.itemsize,
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

    Without either flag the budget on CPU is :func:`default_cpu_kv_budget` (256 MiB, grown to
    hold one sequence of ``max_model_len`` tokens within a quarter of the machine's memory),
    or :func:`kv_budget_from_free` of the free device memory (after the weights are loaded)
    on CUDA, :func:`kv_budget_from_utilization` there with ``gpu_memory_utilization``;
    blocks come from :func:`blocks_in_budget` (the functions ``nybble plan`` uses).
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
                import torch

                free, total = torch.cuda.mem_get_info(device)
                budget = (kv_budget_from_free(free) if cache.gpu_memory_utilization is None else
                          kv_budget_from_utilization(free, total, cache.gpu_memory_utilization))
            else:
                if cache.gpu_memory_utilization is not None:
                    logger.warning("--gpu-memory-utilization applies to a GPU and is ignored "
                                   "on the CPU; size the KV pool with --kv-cache-memory")
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
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"the free memory of {device}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
