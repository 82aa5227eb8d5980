"""Turns a :class:`ScheduledBatch` (numpy) into tensors, runs the model, samples.

One copy per array (``torch.from_numpy`` then ``.to(device)``), no Python loop over tokens.
The runner owns everything torch-side of a step: the model, the KV caches, and the sampling
state of every live sequence (a :class:`SamplingTable`: rows added when the engine core admits
a request, dropped when a sequence finishes). Results leave as numpy arrays.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.models.loader import LoadedModel
from nybble.runtime.batch import ScheduledBatch
from nybble.runtime.kv_cache import KVCacheSpec, allocate_kv_cache
from nybble.runtime.sampler import sample
from nybble.runtime.sampling_table import SamplingTable
from nybble.sampling_params import SamplingParams


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's sampled tokens, ``S`` rows in the order of ``batch.sample_rows``.

    Attributes:
        token_ids: ``int32[S]`` sampled ids.
        logprobs: ``float32[S]`` log-probability of each sampled id under the raw logits,
            or ``None`` when no row asked for logprobs.
        top_token_ids, top_logprobs: ``int64[S, k]`` / ``float32[S, k]``, the ``k`` most
            likely ids of each row (``k``: the largest ``logprobs`` asked for), or ``None``.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None
    top_token_ids: np.ndarray | None
    top_logprobs: np.ndarray | None


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


class ModelRunner:
    """Owns the model, the per-layer KV caches and the per-sequence sampling state.

    Args:
        loaded: the loaded model.
        spec: the KV pool to allocate.
        device: where the model and cache live.
        seed: seed of the generator used by sequences without their own seed.
    """

    def __init__(self, loaded: LoadedModel, spec: KVCacheSpec, device: torch.device,
                 seed: int) -> None:
        self.model = loaded.model
        self.spec = spec
        self.device = device
        self.kv_caches = allocate_kv_cache(spec, device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.sampling = SamplingTable(loaded.shape.vocab_size, device)

    def add_request(self, first_seq_id: int, params: SamplingParams) -> None:
        """Add the sampling rows of a request's ``params.n`` sequences (at admission)."""
        self.sampling.add(first_seq_id, params)

    def remove_sequences(self, seq_ids: Iterable[int]) -> None:
        """Drop the sampling rows of finished or aborted sequences."""
        self.sampling.remove(seq_ids)

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, dtype=dtype, non_blocking=True)

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write: duplicate KV blocks ``src[i] -> dst[i]`` in every layer."""
        src_t = self._tensor(src, torch.int64)
        dst_t = self._tensor(dst, torch.int64)
        for cache in self.kv_caches:
            cache[:, dst_t] = cache[:, src_t]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run one step and sample the rows ``batch.sample_rows`` with the sampling state of
        ``batch.sample_seq_ids``.

        Returns:
            :class:`ModelRunnerOutput` with ``len(batch.sample_rows)`` rows, in that order.
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
        out = sample(logits, self.sampling.batch(batch.sample_seq_ids), self.generator)
        return ModelRunnerOutput(
            token_ids=out.token_ids.to(device="cpu", dtype=torch.int32).numpy(),
            logprobs=_numpy(out.logprobs), top_token_ids=_numpy(out.top_ids),
            top_logprobs=_numpy(out.top_logprobs))
