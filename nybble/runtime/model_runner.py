"""Turns a :class:`ScheduledBatch` (numpy) into tensors, runs the model, samples.

One copy per array (``torch.from_numpy`` then ``.to(device)``), no Python loop over tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.models.loader import LoadedModel
from nybble.runtime.batch import ScheduledBatch
from nybble.runtime.kv_cache import KVCacheSpec, allocate_kv_cache
from nybble.runtime.sampler import SamplerOutput, SamplingBatch, sample


class ModelRunner:
    """Owns the model, the per-layer KV caches and the shared sampling generator.

    Args:
        loaded: the loaded model.
        spec: the KV pool to allocate.
        device: where the model and cache live.
        seed: seed of the generator used by requests without their own seed.
    """

    def __init__(self, loaded: LoadedModel, spec: KVCacheSpec, device: torch.device,
                 seed: int) -> None:
        self.model = loaded.model
        self.spec = spec
        self.device = device
        self.kv_caches = allocate_kv_cache(spec, device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, dtype=dtype, non_blocking=True)

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write: duplicate KV blocks ``src[i] -> dst[i]`` in every layer."""
        src_t = self._tensor(src, torch.int64)
        dst_t = self._tensor(dst, torch.int64)
        for cache in self.kv_caches:
            cache[:, dst_t] = cache[:, src_t]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, params: SamplingBatch) -> SamplerOutput:
        """Run one step and sample the rows ``batch.sample_rows``.

        Returns:
            :class:`SamplerOutput` with ``len(batch.sample_rows)`` rows, in that order.
        """
        if len(batch.copy_src):
            self._copy_blocks(batch.copy_src, batch.copy_dst)
        b = batch.num_seqs
        meta = AttentionMetadata(
            slot_mapping=self._tensor(batch.slot_mapping, torch.int64),
            query_start_loc=self._tensor(batch.query_start_loc, torch.int32),
            seq_lens=self._tensor(batch.seq_lens, torch.int32),
            block_tables=self._tensor(batch.block_tables[:b], torch.int32),
            max_query_len=int(batch.max_query_len), max_seq_len=int(batch.max_seq_len),
            is_decode_only=int(batch.max_query_len) == 1)
        hidden = self.model(self._tensor(batch.input_ids, torch.int64),
                            self._tensor(batch.positions, torch.int64), self.kv_caches, meta)
        rows = self._tensor(batch.sample_rows, torch.int64)
        logits = self.model.compute_logits(hidden[rows])
        return sample(logits, params, self.generator)
