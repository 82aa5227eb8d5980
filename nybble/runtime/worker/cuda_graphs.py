"""Decode steps replayed from CUDA graphs captured for batch-size buckets.

A decode step launches a few dozen small kernels per layer; on a GPU their launch cost, not
their math, bounds small batches. As vLLM and nano-vllm do, the decode forward is captured once
per bucket of batch sizes at start-up (``torch.cuda.CUDAGraph``, one shared memory pool,
largest bucket first) and a step of ``B`` sequences replays the graph of the smallest bucket
``b >= B``: its inputs fill rows ``[0, B)`` of static buffers and rows ``[B, b)`` are padding
that reads block 0 and writes nothing (slot ``-1``). The graphs are captured with
``max_seq_len = max_model_len`` so the attention kernels' launch grid covers any context; the
kernels stop at each row's own ``seq_len``.

Off CUDA (``capture=False``) the same padded path runs eagerly on the static buffers; the tests
use it to check the padding on the CPU.
"""
from __future__ import annotations

import numpy as np
import torch

from nybble.config import MAX_CUDA_GRAPH_SIZE
from nybble.kernels.interface import AttentionMetadata
from nybble.models.llama import LlamaForCausalLM
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.worker.step_inputs import StepInputs


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """The buckets to capture: ``sizes`` (those ``<= max_num_seqs``), by default 1, 2, 4 then
    multiples of 8 up to ``min(max_num_seqs, 512)``; the largest is always ``max_num_seqs``
    when that is at most 512 (sorted, distinct)."""
    top = min(max_num_seqs, MAX_CUDA_GRAPH_SIZE)
    if sizes is None:
        sizes = (1, 2, 4, *range(8, top + 1, 8), top)
    return sorted({b for b in sizes if b <= top})


# Padding rows: token 0 at position 0, one cached token in block 0, KV not written.
_PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 1, "block_tables": 0}


class DecodeGraphs:
    """The decode forward for padded batch-size buckets, as CUDA graphs or (off CUDA) eagerly.

    Args:
        model: the model (its attention backend must be graph-safe: no host syncs; Triton).
        kv_caches: the per-layer KV caches the graphs read and write.
        sizes: the buckets (see :func:`capture_sizes`).
        inputs: persistent step buffers (``copy`` mode) holding at least ``sizes[-1]`` rows;
            the graphs read their device buffers.
        max_model_len: the metadata's ``max_seq_len`` at capture (tokens).
        capture: capture CUDA graphs (CUDA only); ``False`` runs the padded path eagerly.

    Raises:
        ValueError: ``capture`` off CUDA, or ``inputs`` not in copy mode.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor],
                 sizes: list[int], inputs: StepInputs, max_model_len: int,
                 capture: bool) -> None:
        if capture and inputs.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {inputs.device.type!r}")
        if not inputs.copy:
            raise ValueError("DecodeGraphs needs StepInputs with copy=True (fixed buffers)")
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.inputs, self.max_model_len = inputs, max_model_len
        self._query_start_loc = torch.arange(sizes[-1] + 1, dtype=torch.int32,
                                             device=inputs.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` is a decode step that fits a bucket."""
        return batch.max_query_len == 1 and 0 < batch.num_seqs <= self.sizes[-1]

    def _bucket(self, num_seqs: int) -> int:
        return self.sizes[int(np.searchsorted(self.sizes, num_seqs))]

    def _forward(self, size: int) -> torch.Tensor:
        buf = self.inputs.buffer
        meta = AttentionMetadata(
            slot_mapping=buf("slot_mapping")[:size],
            query_start_loc=self._query_start_loc[:size + 1], seq_lens=buf("seq_lens")[:size],
            block_tables=buf("block_tables")[:size], max_query_len=1,
            max_seq_len=self.max_model_len, is_decode_only=True)
        return self.model(buf("input_ids")[:size], buf("positions")[:size], self.kv_caches,
                          meta)

    def _fill(self, batch: ScheduledBatch | None, size: int) -> None:
        """Rows ``[0, B)`` from ``batch`` (none when ``None``), padding up to ``size``."""
        for name, pad in _PAD.items():
            array = _EMPTY[name] if batch is None else getattr(batch, name)
            self.inputs.put(name, array, size, pad)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        device = self.inputs.device
        for size in reversed(self.sizes):   # the largest first: the others reuse its memory
            self._fill(None, size)
            self._forward(size)             # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """The final hidden states ``[B, hidden]`` of a decode ``batch`` (see
        :meth:`can_run`); writes the step's K/V like the eager forward.

        NOTE: the result is a view of the graph's static output, valid until the next run.
        """
        size = self._bucket(batch.num_seqs)
        self._fill(batch, size)
        if size in self._graphs:
            graph, hidden = self._graphs[size]
            graph.replay()
        else:
            hidden = self._forward(size)
        return hidden[:batch.num_seqs]


_EMPTY = {"input_ids": np.zeros(0, np.int32), "positions": np.zeros(0, np.int64),
          "slot_mapping": np.zeros(0, np.int64), "seq_lens": np.zeros(0, np.int32),
          "block_tables": np.zeros((0, 1), np.int32)}
