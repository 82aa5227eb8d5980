"""KV-pool arithmetic shared by the engine's start-up and ``nybble plan`` (torch-free).

One implementation: :func:`nybble.runtime.worker.kv_cache.plan_kv_cache` sizes the engine's pool
with
these functions, and the planner (:mod:`nybble.plan_cli`) calls the same ones with the memory
figures the user gives, so the two agree to the block.

A block holds ``block_size`` tokens of every layer (PagedAttention, Kwon et al., SOSP 2023):
``bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes``
(keys and values). Quantized caches (``int8``, ``fp8_e4m3``) store one byte per element plus
one float32 scale per layer, K/V and KV head (:mod:`nybble.runtime.worker.kv_calibration`); the
scales are a fixed ``8 * num_layers * num_kv_heads`` bytes, outside the blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from nybble.config import KV_CACHE_DTYPES

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
    for ``auto``, else 1.

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


def fit_max_model_len(pool_tokens: int, max_model_len: int, user_set: bool) -> int:
    """The ``max_model_len`` the engine serves with a KV pool of ``pool_tokens`` slots.

    A length the user did not set (the model's own limit) is lowered to the pool's tokens, so
    a request without ``max_tokens`` (the rest of the context) is never refused for a limit the
    user did not choose (llama.cpp's ``--fit``); a length the user set must fit (vLLM's rule).

    Raises:
        ValueError: ``user_set`` and one sequence of ``max_model_len`` tokens needs more than
            the pool's ``pool_tokens`` slots (the message names both and the flags to change).
    """
    if pool_tokens >= max_model_len:
        return max_model_len
    if user_set:
        raise ValueError(f"max_model_len must fit in the KV cache: {max_model_len} tokens were "
                         f"asked for, but the pool holds {pool_tokens} tokens; lower "
                         f"--max-model-len to at most {pool_tokens} or raise "
                         f"--kv-cache-memory / --num-gpu-blocks")
    return pool_tokens
