"""SamplingTable: the model runner's persistent per-sequence sampling state.

One row per live sequence (one sample of a request): temperature, top-k, top-p, min-p, the
number of logprobs asked for, and the sample's seeded ``torch.Generator`` if it has one. A
request's rows are added when the engine core admits it and dropped when each sample finishes
or is aborted, so nothing is rebuilt from Python lists per step: a step gathers its rows by
index (a :class:`~nybble.runtime.sample.rows.RowAllocator` hands them out). The values live
in host numpy arrays; on the CPU the sampler reads them in place (``torch.from_numpy`` shares
the memory), on a GPU a device copy is refreshed only for the rows written since the previous
step. The table counts its rows that sample randomly and
those that ask for logprobs, so a step where neither exists builds no tensors at all.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from nybble.runtime.sample.rows import RowAllocator
from nybble.runtime.sample.sampler import SamplingBatch
from nybble.sampling_params import SamplingParams, sample_seed

_COLUMNS = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int64,
            "min_p": np.float32}


class SamplingTable:
    """Rows of sampling parameters, addressed by scheduler sequence id.

    Args:
        vocab_size: the model's vocabulary (``top_k`` is capped at it).
        device: where the sampler runs.
        capacity: initial number of rows; the table doubles when full.
        share_host_memory: read the host arrays in place instead of keeping a device copy;
            default: on the CPU only.
    """

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64,
                 share_host_memory: bool | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.shared = device.type == "cpu" if share_host_memory is None else share_host_memory
        self._gens: list[torch.Generator | None] = []
        self._num_seeded = 0
        self._num_random = 0                         # rows with temperature > 0
        self._num_logprobs = 0                       # rows that ask for logprobs
        self._greedy_batches: dict[int, SamplingBatch] = {}
        self._dirty: set[int] = set()
        self._host: dict[str, np.ndarray] = {}
        self._dev: dict[str, torch.Tensor] = {}
        self._logprobs = np.zeros(0, np.int32)      # -1: none asked (host only)
        self._allocator = RowAllocator(capacity, self._grow)

    def __len__(self) -> int:
        """Rows in use (live sequences)."""
        return len(self._allocator)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._allocator

    @property
    def capacity(self) -> int:
        """Rows allocated (in use or free)."""
        return self._allocator.capacity

    @property
    def num_pending_uploads(self) -> int:
        """Rows written since the last :meth:`batch` that the device copy lacks (0 when the
        host memory is shared)."""
        return 0 if self.shared else len(self._dirty)

    def _grow(self, old: int, capacity: int) -> None:
        """Grow every column from ``old`` to ``capacity`` rows (the allocator's ``on_grow``)."""
        for name, dtype in _COLUMNS.items():
            col = np.zeros(capacity, dtype)
            col[:old] = self._host.get(name, col[:0])
            self._host[name] = col
        logprobs = np.full(capacity, -1, np.int32)
        logprobs[:old] = self._logprobs
        self._logprobs = logprobs
        self._gens += [None] * (capacity - old)
        if self.shared:
            self._dev = {k: torch.from_numpy(v) for k, v in self._host.items()}
        else:   # NOTE: a fresh copy of every column: nothing is pending any more
            self._dev = {k: torch.from_numpy(v.copy()).to(self.device)
                         for k, v in self._host.items()}
        self._dirty.clear()

    def add(self, first_seq_id: int, params: SamplingParams) -> None:
        """Add the rows of sequences ``first_seq_id .. first_seq_id + n - 1`` (one per sample;
        ``n`` is ``params.num_sequences``: ``best_of`` when set).

        Sample ``i`` of a seeded, non-greedy request gets its own generator seeded
        ``sample_seed(seed, i)``: its tokens do not depend on what else is batched.

        Raises:
            ValueError: a sequence id already has a row (nothing is added then).
        """
        n = params.num_sequences
        ids = range(first_seq_id, first_seq_id + n)
        seed = None if params.greedy else params.seed
        gens = [None if seed is None else
                torch.Generator(device=self.device).manual_seed(sample_seed(seed, i))
                for i in range(n)]
        # NOTE: every conversion that can raise comes before the first change (all or nothing;
        # the allocator checks the ids before it changes anything)
        values = {"temperature": params.temperature, "top_p": params.top_p,
                  "top_k": min(params.top_k, self.vocab_size) if params.top_k > 0 else -1,
                  "min_p": params.min_p}
        values = {name: _COLUMNS[name](value) for name, value in values.items()}
        # NOTE: best_of ranks samples by cumulative logprob, so its rows need the chosen
        # token's logprob even when the caller asked for none
        asked = params.logprobs if params.logprobs is not None else \
            0 if n > params.n else None
        num_logprobs = np.int32(-1 if asked is None else asked)
        for row, gen in zip(self._allocator.add(ids), gens):
            for name, value in values.items():
                self._host[name][row] = value
            self._logprobs[row] = num_logprobs
            self._gens[row] = gen
            self._num_seeded += gen is not None
            self._num_random += params.temperature > 0
            self._num_logprobs += asked is not None
            self._dirty.add(row)

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Drop the rows of ``seq_ids`` (finished or aborted); unknown ids are ignored."""
        for seq_id in seq_ids:
            row = self._allocator.remove(seq_id)
            if row is None:
                continue
            self._num_seeded -= self._gens[row] is not None
            self._num_random -= bool(self._host["temperature"][row] > 0)
            self._num_logprobs -= bool(self._logprobs[row] >= 0)
            self._gens[row] = None
            self._dirty.discard(row)

    def _upload(self) -> None:
        """Copy the rows written since the last step to the device copy."""
        if not self._dirty or self.shared:
            self._dirty.clear()
            return
        rows = np.fromiter(self._dirty, np.int64, len(self._dirty))
        index = torch.from_numpy(rows).to(self.device)
        for name, col in self._host.items():
            self._dev[name][index] = torch.from_numpy(col[rows]).to(self.device)
        self._dirty.clear()

    def _greedy(self, max_logprobs: int) -> SamplingBatch:
        """A batch whose rows are all greedy: only ``max_logprobs`` is read (one cached
        object per value)."""
        batch = self._greedy_batches.get(max_logprobs)
        if batch is None:
            empty = torch.zeros(0, device=self.device)
            index = torch.zeros(0, dtype=torch.int64, device=self.device)
            batch = self._greedy_batches[max_logprobs] = SamplingBatch(
                empty, empty, index, empty, [], max_logprobs, index, all_greedy=True,
                use_top_k_top_p=False, use_min_p=False)
        return batch

    def batch(self, seq_ids: np.ndarray) -> SamplingBatch:
        """The :class:`SamplingBatch` of the rows of ``seq_ids`` (one per sampled token, in
        that order). Its flags (all greedy, top-k/top-p, min-p) are computed here, on the
        host; when every row is greedy no parameter is gathered.

        Raises:
            KeyError: a sequence id without a row (a bug: the core adds rows at admission).
        """
        self._upload()
        if not self._num_random and not self._num_logprobs:
            return self._greedy(-1)
        seqs = seq_ids.tolist()
        rows = self._allocator.rows(seqs, len(seqs))
        max_logprobs = int(self._logprobs[rows].max()) if self._num_logprobs and len(seqs) \
            else -1
        host = self._host
        random = host["temperature"][rows] > 0
        if not random.any():
            return self._greedy(max_logprobs)
        chosen = rows[random]
        top_k, top_p = host["top_k"][chosen], host["top_p"][chosen]
        keeps_fewer = ((top_k > 0) & (top_k < self.vocab_size)) | (top_p < 1)
        index = torch.from_numpy(rows).to(self.device)
        d = self._dev
        gens = [self._gens[r] for r in rows.tolist()] if self._num_seeded else [None] * len(seqs)
        return SamplingBatch(temperature=d["temperature"][index], top_p=d["top_p"][index],
                             top_k=d["top_k"][index], min_p=d["min_p"][index], generators=gens,
                             max_logprobs=max_logprobs,
                             random_rows=torch.from_numpy(np.flatnonzero(random)).to(self.device),
                             all_greedy=False, use_top_k_top_p=bool(keeps_fewer.any()),
                             use_min_p=bool((host["min_p"][chosen] > 0).any()))
