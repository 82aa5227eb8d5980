"""Whole-sequence logits from nybble's own model: one varlen prefill over a scratch paged KV
cache. Used by ``nybble eval-ppl`` and by tests that compare logits with other tools."""
from __future__ import annotations

import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.models.loader import LoadedModel

SCRATCH_BLOCK_SIZE = 16


@torch.inference_mode()
def prefill_logits(loaded: LoadedModel, sequences: list[list[int]],
                   device: torch.device | None = None, cache_dtype: torch.dtype | None = None,
                   keep_caches: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Logits at every position of every sequence, computed as one prefill batch.

    Args:
        loaded: the model (its attention backend is used as loaded).
        sequences: token ids; each at most ``loaded.max_model_len`` long.
        device: where the model lives (default: the embedding's device).
        cache_dtype: the scratch cache's dtype (default: the model's); ``torch.int8`` /
            ``torch.float8_e4m3fn`` need the layers' ``kv_scale`` set
            (:mod:`nybble.runtime.worker.kv_calibration`).
        keep_caches: when given, the per-layer scratch caches are appended to it.

    Returns:
        One float32 ``[len(seq), vocab]`` tensor per sequence.

    Raises:
        ValueError: an empty sequence or one longer than ``max_model_len``.
    """
    lens = [len(s) for s in sequences]
    if not lens or min(lens) < 1 or max(lens) > loaded.max_model_len:
        raise ValueError(f"sequence lengths must be in [1, {loaded.max_model_len}], got {lens}")
    model = loaded.model
    device = device or model.embed_tokens.weight.device
    shape = loaded.shard_shape   # this rank's KV heads under tensor parallelism
    bs = SCRATCH_BLOCK_SIZE
    blocks = [(n + bs - 1) // bs for n in lens]
    width = max(blocks)
    # Sequence i owns blocks [start_i, start_i + blocks_i) of the scratch pool.
    starts = torch.tensor([0] + blocks[:-1]).cumsum(0)
    cols = torch.arange(width)[None, :]
    tables = torch.where(cols < torch.tensor(blocks)[:, None], starts[:, None] + cols, -1)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = tables[seq_of, pos // bs] * bs + pos % bs
    qsl = torch.tensor([0] + lens).cumsum(0)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(slot_mapping=slots.to(device), query_start_loc=qsl.to(**i32),
                             seq_lens=torch.tensor(lens, **i32), block_tables=tables.to(**i32),
                             max_query_len=max(lens), max_seq_len=max(lens),
                             is_decode_only=max(lens) == 1)
    dtype = cache_dtype or model.embed_tokens.weight.dtype
    caches = [torch.zeros(2, sum(blocks), bs, shape.num_kv_heads, shape.head_dim, dtype=dtype,
                          device=device) for _ in range(shape.num_layers)]
    if keep_caches is not None:
        keep_caches.extend(caches)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
    hidden = model(ids, pos.to(device), caches, meta)
    return list(model.compute_logits(hidden).float().split(lens))
