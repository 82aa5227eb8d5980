"""Contracts shared by every kernel backend (torch reference and Triton).

Shapes are documented once here. Notation: ``T`` new tokens in the step (all sequences
concatenated), ``B`` sequences in the step, ``Hq`` query heads, ``Hkv`` KV heads
(``Hq % Hkv == 0``, grouped-query attention), ``D`` head dim, ``NB`` KV blocks in the pool,
``BS`` block size (tokens), ``MB`` max blocks per sequence (block-table width).

KV cache layout (one tensor per layer), as in PagedAttention (Kwon et al., SOSP 2023):
``kv_cache: [2, NB, BS, Hkv, D]``; ``kv_cache[0]`` holds keys, ``kv_cache[1]`` values.
Token ``j`` of a sequence lives in slot ``block_table[j // BS] * BS + j % BS``; the flat
slot index ``s`` addresses ``kv_cache[:, s // BS, s % BS]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of the varlen paged batch, built by the model runner.

    Sequence ``i`` contributes new tokens ``query_start_loc[i] : query_start_loc[i+1]`` of the
    flat batch; they sit at the last ``q_len_i`` positions of its ``seq_lens[i]`` tokens
    (cached prefix + new tokens), so new token ``t`` of sequence ``i`` attends causally to keys
    ``0 .. seq_lens[i] - q_len_i + t``. This covers prefill, chunked prefill and decode in one
    batch.

    Attributes:
        slot_mapping: ``[T]`` int64, KV slot of each new token (``-1``: do not write).
        query_start_loc: ``[B+1]`` int32, cumulative new-token offsets, starts at 0.
        seq_lens: ``[B]`` int32, tokens of each sequence after this step (cached + new).
        block_tables: ``[B, MB]`` int32, KV block ids; entries past a sequence's blocks are
            padding (``-1`` or any block id of the pool; never read).
        max_query_len: ``max(q_len_i)`` (python int, tokens).
        max_seq_len: ``max(seq_lens)`` (python int, tokens).
        is_decode_only: every sequence has exactly one new token (lets a backend use its
            decode kernel).
        plan: backend-private derivations of the fields above (gather indices, masks) that
            every layer of the step reuses: the first layer makes it, ``None`` until then.
            NOTE: a metadata object describes one step; build a new one per step.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool
    plan: Any = None


class AttentionBackend(Protocol):
    """A paged-attention implementation.

    Pre-conditions: ``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` share the cache's dtype
    and device; ``Hq % Hkv == 0``. Post-condition of ``reshape_and_cache``: for every ``t`` with
    ``slot_mapping[t] >= 0``, ``kv_cache[0, slot // BS, slot % BS] == key[t]`` (values alike).
    ``forward`` returns ``[T, Hq, D]`` in the query's dtype, computed with fp32 accumulation.
    Both are called once per layer with the step's one metadata object. A quantized cache
    (``int8`` / ``float8_e4m3fn``) takes the layer's per-head scales ``kv_scale [2, Hkv]``
    float32 in both calls: the write stores ``quant(x / scale)``, attention reads
    ``float(q) * scale`` (:mod:`nybble.kernels.kv_quant`); a float cache ignores it. A
    quantized cache may hold its keys before RoPE: then ``forward`` gets ``rotary_keys``
    (:class:`nybble.kernels.kv_quant.RotaryKeys`, the keys' zero point and the layer's rotary
    table) and rotates each key by its position as it reads it.
    """

    name: str

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          kv_scale: torch.Tensor | None = None) -> None:
        """Write the new tokens' keys and values into their slots of ``kv_cache``
        (``meta.slot_mapping``; ``-1``: not written)."""
        ...

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scale: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None, rotary_keys: Any = None) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its cached keys/values; with
        ``window`` a query at position ``i`` sees keys ``i - window < j <= i`` only (a
        sliding-window layer), with ``softcap`` each scaled score ``s`` becomes
        ``softcap * tanh(s / softcap)`` (Gemma 2); with ``rotary_keys`` the cached keys are
        pre-RoPE (see above). ``rotary_keys`` with a float cache raises ``ValueError``."""
        ...
