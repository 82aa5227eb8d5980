"""The Triton attention backend (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import RotaryKeys
from nybble.kernels.triton.cache import reshape_and_cache
from nybble.kernels.triton.paged_decode import paged_decode_attention
from nybble.kernels.triton.paged_prefill import paged_prefill_attention


class TritonAttentionBackend:
    """:class:`~nybble.kernels.interface.AttentionBackend` built from the Triton kernels.

    ``forward`` uses the split-KV flash-decoding kernel when every sequence has exactly one new
    token (``meta.is_decode_only``) and the varlen FlashAttention-2 kernel otherwise (prefill,
    chunked prefill, mixed batches).
    """

    name = "triton"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          kv_scale: torch.Tensor | None = None) -> None:
        """See :func:`nybble.kernels.triton.cache.reshape_and_cache` (``meta.slot_mapping``)."""
        reshape_and_cache(key, value, kv_cache, meta.slot_mapping, kv_scale)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scale: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None,
                rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
        """Causal paged attention, ``[T, Hq, D] -> [T, Hq, D]`` (see the protocol; ``window``,
        ``softcap`` and ``rotary_keys`` as in
        :func:`~nybble.kernels.reference.attention.paged_attention`)."""
        if meta.is_decode_only:
            return paged_decode_attention(query, kv_cache, meta, scale, kv_scale=kv_scale,
                                          window=window, softcap=softcap,
                                          rotary_keys=rotary_keys)
        return paged_prefill_attention(query, kv_cache, meta, scale, kv_scale=kv_scale,
                                       window=window, softcap=softcap, rotary_keys=rotary_keys)
