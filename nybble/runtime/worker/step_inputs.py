"""StepInputs: the step's index arrays as tensors on the model's device, without new tensors
per step.

On the CPU (``copy=False``) a tensor shares the scheduler's numpy buffer (``torch.from_numpy``:
no copy; the buffers stay valid until the next ``schedule()``, after the step). Otherwise every
field has a host staging buffer (pinned on CUDA) and a device buffer, both sized once for the
largest step; :meth:`StepInputs.put` fills a slice of each, one host-to-device copy per field,
no allocation. CUDA graphs read these device buffers at fixed addresses.
"""
from __future__ import annotations

import numpy as np
import torch

_DTYPES = {"input_ids": torch.int32, "positions": torch.int64, "slot_mapping": torch.int64,
           "seq_lens": torch.int32, "query_start_loc": torch.int32,
           "block_tables": torch.int32, "sample_rows": torch.int64, "copy_src": torch.int64,
           "copy_dst": torch.int64}


class StepInputs:
    """Device tensors of a :class:`~nybble.runtime.scheduler.batch.ScheduledBatch`'s arrays.

    Args:
        device: where the model runs.
        max_num_tokens: tokens in the largest step (``max_num_batched_tokens``).
        max_num_seqs: sequences (and sampled rows) in the largest step.
        block_table_width: ``ceil(max_model_len / block_size)`` block ids per sequence.
        copy: copy into persistent buffers (default: off the CPU only).
    """

    def __init__(self, device: torch.device, max_num_tokens: int, max_num_seqs: int,
                 block_table_width: int, copy: bool | None = None) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}
        if not self.copy:
            return
        t, b = max_num_tokens, max_num_seqs
        rows = {"input_ids": t, "positions": t, "slot_mapping": t, "seq_lens": b,
                "query_start_loc": b + 1, "block_tables": b, "sample_rows": max(t, b),
                "copy_src": b, "copy_dst": b}
        pin = device.type == "cuda"
        for name, n in rows.items():
            shape = (n, block_table_width) if name == "block_tables" else (n,)
            self._host[name] = torch.empty(shape, dtype=_DTYPES[name], pin_memory=pin)
            self._dev[name] = torch.empty(shape, dtype=_DTYPES[name], device=device)

    def buffer(self, name: str) -> torch.Tensor:
        """The whole device buffer of a field (``copy`` mode): CUDA graphs capture slices of
        it."""
        return self._dev[name]

    def put(self, name: str, array: np.ndarray, size: int | None = None,
            pad: int = 0) -> torch.Tensor:
        """``array`` (a field of the batch, or ``copy_src``/``copy_dst``) as a device tensor:
        the first ``size`` rows of the field's buffer (default ``len(array)``), rows past
        ``len(array)`` set to ``pad``."""
        if not self.copy:
            return torch.from_numpy(array)
        n = array.shape[0]
        size = n if size is None else size
        host, dev = self._host[name], self._dev[name]
        if n:
            np.copyto(host[:n].numpy(), array, casting="same_kind")
        if size > n:
            host[n:size].fill_(pad)
        return dev[:size].copy_(host[:size], non_blocking=True)
