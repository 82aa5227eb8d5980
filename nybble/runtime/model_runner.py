"""Turns a :class:`ScheduledBatch` (numpy) into tensors, runs the model, samples.

No Python loop over tokens, no new tensor per step for the inputs: on the CPU each array is
shared with the scheduler's buffer, on a GPU it fills a slice of a persistent buffer
(:class:`StepInputs`). A decode step samples every hidden row as it is (no gather), and an
all-greedy batch costs one argmax.
The runner owns everything torch-side of a step: the model, the KV caches, and the sampling
state of every live sequence (a :class:`SamplingTable`: rows added when the engine core admits
a request, dropped when a sequence finishes). Results leave as numpy arrays.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from nybble.config import EngineConfig
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


def _host(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


class StepInputs:
    """The step's index arrays as device tensors, without new tensors per step on a GPU.

    On the CPU a tensor shares the scheduler's numpy buffer (``torch.from_numpy``: no copy;
    the buffers stay valid until the next ``schedule()``, after the step). On a GPU every
    field has a pinned host staging buffer and a device buffer, both sized once for the
    largest step; :meth:`put` fills a slice of each (one host-to-device copy, no allocation).

    Args:
        device: where the model runs.
        max_num_tokens: tokens in the largest step (``max_num_batched_tokens``).
        max_num_seqs: sequences (and sampled rows) in the largest step.
        block_table_width: ``ceil(max_model_len / block_size)`` block ids per sequence.
    """

    def __init__(self, device: torch.device, max_num_tokens: int, max_num_seqs: int,
                 block_table_width: int) -> None:
        self.device = device
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}
        if device.type == "cpu":
            return
        t, b = max_num_tokens, max_num_seqs
        shapes = {"input_ids": ((t,), torch.int32), "positions": ((t,), torch.int64),
                  "slot_mapping": ((t,), torch.int64), "seq_lens": ((b,), torch.int32),
                  "query_start_loc": ((b + 1,), torch.int32),
                  "block_tables": ((b, block_table_width), torch.int32),
                  "sample_rows": ((max(t, b),), torch.int64),
                  "copy_src": ((b,), torch.int64), "copy_dst": ((b,), torch.int64)}
        for name, (shape, dtype) in shapes.items():
            self._host[name] = torch.empty(shape, dtype=dtype, pin_memory=True)
            self._dev[name] = torch.empty(shape, dtype=dtype, device=device)

    def put(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` (a field of :class:`ScheduledBatch`, or ``copy_src``/``copy_dst``) as
        a tensor on the device: the first ``len(array)`` rows of the field's buffer."""
        if self.device.type == "cpu":
            return torch.from_numpy(array)
        n = array.shape[0]
        host, dev = self._host[name][:n], self._dev[name][:n]
        np.copyto(host.numpy(), array, casting="same_kind")
        return dev.copy_(host, non_blocking=True)


class ModelRunner:
    """Owns the model, the per-layer KV caches and the per-sequence sampling state.

    Args:
        loaded: the loaded model.
        spec: the KV pool to allocate.
        device: where the model and cache live.
        config: the engine configuration (seed, step limits).
    """

    def __init__(self, loaded: LoadedModel, spec: KVCacheSpec, device: torch.device,
                 config: EngineConfig) -> None:
        self.model = loaded.model
        self.spec = spec
        self.device = device
        self.kv_caches = allocate_kv_cache(spec, device)
        self.generator = torch.Generator(device=device).manual_seed(config.model_config.seed)
        self.sampling = SamplingTable(loaded.shape.vocab_size, device)
        sc = config.scheduler_config
        self.inputs = StepInputs(device, sc.max_num_batched_tokens, sc.max_num_seqs,
                                 -(-loaded.max_model_len // spec.block_size))
        self._arange = np.arange(max(sc.max_num_batched_tokens, sc.max_num_seqs),
                                 dtype=np.int32)

    def add_request(self, first_seq_id: int, params: SamplingParams) -> None:
        """Add the sampling rows of a request's ``params.n`` sequences (at admission)."""
        self.sampling.add(first_seq_id, params)

    def remove_sequences(self, seq_ids: Iterable[int]) -> None:
        """Drop the sampling rows of finished or aborted sequences."""
        self.sampling.remove(seq_ids)

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write: duplicate KV blocks ``src[i] -> dst[i]`` in every layer."""
        src_t = self.inputs.put("copy_src", src.astype(np.int64))
        dst_t = self.inputs.put("copy_dst", dst.astype(np.int64))
        for cache in self.kv_caches:
            cache[:, dst_t] = cache[:, src_t]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata]:
        """``(input_ids [T] int32, positions [T] int64, metadata)`` of ``batch`` on the
        device; one object per field, no copy on the CPU."""
        put = self.inputs.put
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", batch.slot_mapping),
            query_start_loc=put("query_start_loc", batch.query_start_loc),
            seq_lens=put("seq_lens", batch.seq_lens),
            block_tables=put("block_tables", batch.block_tables),
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
            is_decode_only=batch.max_query_len == 1)
        return put("input_ids", batch.input_ids), put("positions", batch.positions), meta

    def _sampled_hidden(self, hidden: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        """The rows ``batch.sample_rows`` of ``hidden``; no gather when they are every row
        in order (a decode step)."""
        rows = batch.sample_rows
        if np.array_equal(rows, self._arange[:hidden.shape[0]]):
            return hidden
        return hidden.index_select(0, self.inputs.put("sample_rows", rows.astype(np.int64)))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run one step and sample the rows ``batch.sample_rows`` with the sampling state of
        ``batch.sample_seq_ids``.

        Returns:
            :class:`ModelRunnerOutput` with ``len(batch.sample_rows)`` rows, in that order.
        """
        if len(batch.copy_src):
            self._copy_blocks(batch.copy_src, batch.copy_dst)
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(self._sampled_hidden(hidden, batch))
        out = sample(logits, self.sampling.batch(batch.sample_seq_ids), self.generator)
        return ModelRunnerOutput(
            token_ids=_host(out.token_ids).astype(np.int32),
            logprobs=_host(out.logprobs), top_token_ids=_host(out.top_ids),
            top_logprobs=_host(out.top_logprobs))
