"""The CPU attention backend: the Cython paged decode kernel for decode steps, the torch
reference for everything else.

A decode-only step in float32 runs :func:`nybble.kernels.cpu.attention.paged_decode_attention`,
which reads each sequence's keys and values through its block table up to its own length: no
gathered ``[B, S, Hkv, D]`` copy per layer, no padding to the longest sequence, no mask. Steps
with prefill chunks, and other dtypes, take
:func:`~nybble.kernels.reference.attention.paged_attention`. A quantized (``int8`` /
``fp8_e4m3``) cache's decode steps run the same kernel with the layer's per-head scales (an fp8
cache as its bytes, with a 256-entry table of what each byte stands for), keys cached before RoPE
(:class:`~nybble.kernels.kv_quant.RotaryKeys`) with their zero point and rotary table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import QMAX, RotaryKeys
from nybble.kernels.reference.attention import TorchAttentionBackend, write_rows, write_slots

try:
    from nybble.kernels.cpu.attention import paged_decode_attention
except ImportError:  # the extension is not built (a source checkout without build_ext)
    paged_decode_attention = None


def cpu_kernel_available() -> bool:
    """Whether the compiled CPU decode kernel can be imported."""
    return paged_decode_attention is not None


@dataclass(slots=True)
class DecodeKernelPlan:
    """``meta.plan`` of a decode-only step on this backend: the kernel's index arrays (numpy
    views of the metadata, int32) and the rows that write the cache (``None``: all)."""

    block_tables: np.ndarray
    seq_lens: np.ndarray
    write_rows: torch.Tensor | None


class CpuAttentionBackend(TorchAttentionBackend):
    """:class:`TorchAttentionBackend` whose float32 decode steps run the Cython kernel.

    Raises (constructor):
        RuntimeError: the kernel extension is not built.
    """

    name = "cpu"

    def __init__(self) -> None:
        if paged_decode_attention is None:
            raise RuntimeError("attention_backend 'cpu' needs the compiled "
                               "nybble.kernels.cpu.attention extension (pip install -e .)")
        self._scratch = np.empty(0, np.float32)

    @staticmethod
    def _uses_kernel(meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        return meta.is_decode_only and (kv_cache.dtype == torch.float32 or
                                        kv_cache.dtype in QMAX) and \
            kv_cache.device.type == "cpu" and kv_cache.is_contiguous()

    def _kernel_plan(self, meta: AttentionMetadata) -> DecodeKernelPlan:
        plan = meta.plan
        if not isinstance(plan, DecodeKernelPlan):
            tables = meta.block_tables.numpy().astype(np.int32, copy=False)
            plan = meta.plan = DecodeKernelPlan(
                np.ascontiguousarray(tables), meta.seq_lens.numpy().astype(np.int32, copy=False),
                write_rows(meta.slot_mapping))
        return plan

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          kv_scale: torch.Tensor | None = None) -> None:
        """See :func:`nybble.kernels.reference.attention.reshape_and_cache`."""
        if not self._uses_kernel(meta, kv_cache):
            super().reshape_and_cache(key, value, kv_cache, meta, kv_scale)
            return
        write_slots(key, value, kv_cache, meta.slot_mapping, self._kernel_plan(meta).write_rows,
                    kv_scale)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scale: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None,
                rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
        """Causal paged attention, ``[T, Hq, D] -> [T, Hq, D]`` (see the protocol; ``window``,
        ``softcap`` and ``rotary_keys`` as in
        :func:`~nybble.kernels.reference.attention.paged_attention`)."""
        if not self._uses_kernel(meta, kv_cache) or query.dtype != torch.float32 or \
                (rotary_keys is not None and kv_cache.dtype == torch.float32):
            return super().forward(query, kv_cache, meta, scale, kv_scale, window, softcap,
                                   rotary_keys)
        extra = {"window": window or 0, "softcap": softcap or 0.0}
        plan = self._kernel_plan(meta)
        num_tokens, num_heads, head_dim = query.shape
        need = num_heads * (meta.max_seq_len + head_dim + 1) + \
            (kv_cache.shape[3] + 1) * head_dim
        if self._scratch.shape[0] < need:
            self._scratch = np.empty(max(need, 2 * self._scratch.shape[0]), np.float32)
        out = torch.empty(num_tokens, num_heads, head_dim)
        if kv_cache.dtype == torch.float32:
            paged_decode_attention(query.numpy(), kv_cache.numpy(), plan.block_tables,
                                   plan.seq_lens, scale, out.numpy(), self._scratch, **extra)
            return out
        if kv_scale is None:
            raise ValueError(f"kv_scale must be a [2, Hkv] float32 tensor for a "
                             f"{kv_cache.dtype} KV cache, got None")
        # NOTE: numpy has no float8: an fp8 cache goes as its bytes with a decoding table
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        if rotary_keys is not None:
            extra["key_zero"] = rotary_keys.zero.numpy()
            extra["cos_sin"] = rotary_keys.cos_sin.numpy()
        paged_decode_attention(query.numpy(),
                               (kv_cache.view(torch.uint8) if fp8 else kv_cache).numpy(),
                               plan.block_tables, plan.seq_lens, scale, out.numpy(),
                               self._scratch, kv_scale.contiguous().numpy(),
                               _byte_values(kv_cache.dtype) if fp8 else None, **extra)
        return out


_BYTE_VALUES: dict[torch.dtype, np.ndarray] = {}


def _byte_values(dtype: torch.dtype) -> np.ndarray:
    """``[256]`` float32: the value byte ``i`` of a ``dtype`` (float8_e4m3fn) cache holds,
    decoded once by torch (the kernel's lookup table)."""
    table = _BYTE_VALUES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = _BYTE_VALUES[dtype] = codes.view(dtype).float().numpy()
    return table
