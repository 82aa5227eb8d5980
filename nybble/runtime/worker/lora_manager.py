"""The engine side of multi-LoRA serving: a host LRU cache of loaded adapters, the device slots
it fills, and each sequence's slot.

* :meth:`LoRAManager.load` reads and checks an adapter folder once
  (:func:`nybble.lora_files.read_adapter`, then the tensors) and keeps it in a host cache of
  ``max_cpu_loras`` adapters, least recently used evicted first (never one that sits in a
  pinned slot);
* :meth:`LoRAManager.acquire` pins a device slot for a request: the adapter's own slot when it
  is resident, else a free slot, else the least recently used unpinned one (its adapter is
  evicted from the device); ``None`` when every slot is pinned by running requests (the
  request then waits, :mod:`nybble.runtime.engine.lora_admission`); :meth:`release` unpins;
* :meth:`token_slots` turns a step's sequences into the per-row slot index the model reads
  (one numpy gather and one ``repeat``; ``None`` when no row uses an adapter).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from nybble.config import LoRAConfig
from nybble.errors import LoRAAdapterError
from nybble.lora_files import read_adapter
from nybble.lora_request import LoRARequest
from nybble.models.llama import LlamaForCausalLM
from nybble.models.lora import AdapterWeights, load_adapter_weights
from nybble.runtime.scheduler.batch import ScheduledBatch

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters on the host and in the model's device slots.

    Under tensor parallelism rank 0's manager decides for every rank: :attr:`on_write` tells
    the workers to fill the same slot from the same folder, and the rows' slots travel with
    each step (:mod:`nybble.runtime.executor.step_payload`).

    Args:
        model: the loaded model; :meth:`LlamaForCausalLM.enable_lora` is called here.
        config: ``max_loras`` slots, ``max_lora_rank``, ``max_cpu_loras`` host entries.
    """

    def __init__(self, model: LlamaForCausalLM, config: LoRAConfig) -> None:
        self.config = config
        # tensor parallelism: tells the workers to fill a slot (slot, adapter folder)
        self.on_write: Callable[[int, str], None] | None = None
        self.slots = model.enable_lora(config.max_loras, config.max_lora_rank)
        self.targets = model.lora_targets()
        self.dtype = model.norm.weight.dtype
        self.device = model.norm.weight.device
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()   # LRU first
        self._paths: dict[int, str] = {}                 # lora_int_id -> its folder
        self._resident: list[int | None] = [None] * config.max_loras    # slot -> adapter id
        self._pins = [0] * config.max_loras
        self._used = [0] * config.max_loras             # slot -> last acquire (LRU)
        self._clock = 0
        self._seq_slot = np.full(1024, -1, np.int64)    # seq id -> slot (-1: base)
        logger.info("LoRA: %d device slot(s) of rank <= %d (%.2f MiB), %d adapter(s) cached "
                    "on the host", config.max_loras, config.max_lora_rank,
                    self.slots.nbytes / 2**20, config.cpu_loras)

    # ------------------------------------------------------------------ adapters
    def load(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's weights, from the host cache or read now (and cached).

        Raises:
            LoRAAdapterError: the folder cannot be served on this base (see
                :func:`~nybble.lora_files.read_adapter`), or ``lora_int_id`` was used before
                for another folder.
        """
        known = self._paths.get(lora.lora_int_id)
        if known is not None and known != lora.lora_path:
            raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} names {known} already, "
                                   f"not {lora.lora_path}: give each adapter its own id",
                                   param="lora_int_id")
        weights = self._host.get(lora.lora_int_id)
        if weights is not None:
            self._host.move_to_end(lora.lora_int_id)
            return weights
        spec = read_adapter(lora.lora_path, self.targets, self.config.max_lora_rank)
        weights = load_adapter_weights(spec, self.dtype)
        self._paths[lora.lora_int_id] = lora.lora_path
        pinned = {a for a, p in zip(self._resident, self._pins) if p > 0}
        while len(self._host) >= self.config.cpu_loras:
            victim = next((a for a in self._host if a not in pinned), None)
            if victim is None:
                return weights          # NOTE: every cached adapter runs: do not cache this one
            del self._host[victim]
        self._host[lora.lora_int_id] = weights
        return weights

    def acquire(self, lora: LoRARequest) -> int | None:
        """Pin a device slot holding ``lora`` for one request; ``None`` when every slot is
        pinned by other adapters' running requests.

        Raises:
            LoRAAdapterError: as :meth:`load` (when the adapter must be read again).
        """
        self._clock += 1
        lid = lora.lora_int_id
        if lid in self._resident:
            slot = self._resident.index(lid)
        else:
            free = [s for s in range(len(self._pins)) if self._pins[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self._resident[s] is not None, self._used[s]))
            weights = self.load(lora)
            self._resident[slot] = None     # NOTE: write() clears the slot before it fills it
            self.slots.write(slot, weights)
            if self.on_write is not None:
                self.on_write(slot, lora.lora_path)
            self._resident[slot] = lid
        self._pins[slot] += 1
        self._used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """Unpin ``slot`` for one finished request (its adapter stays resident until the slot
        is needed)."""
        assert self._pins[slot] > 0, f"slot {slot} is not pinned"
        self._pins[slot] -= 1

    def running_adapters(self) -> dict[int, int]:
        """``lora_int_id -> requests pinning it`` of the resident adapters in use."""
        return {a: p for a, p in zip(self._resident, self._pins) if a is not None and p > 0}

    # ------------------------------------------------------------------ sequences
    def assign(self, first_seq_id: int, count: int, slot: int) -> None:
        """Sequences ``first_seq_id .. + count - 1`` run under ``slot``."""
        end = first_seq_id + count
        if end > len(self._seq_slot):
            grown = np.full(max(2 * len(self._seq_slot), end), -1, np.int64)
            grown[:len(self._seq_slot)] = self._seq_slot
            self._seq_slot = grown
        self._seq_slot[first_seq_id:end] = slot

    def forget(self, first_seq_id: int, count: int) -> None:
        """Sequences ``first_seq_id .. + count - 1`` are gone (back to the base's -1)."""
        self._seq_slot[first_seq_id:first_seq_id + count] = -1

    def token_slots(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """``[T]`` int64 slot of each token row of ``batch`` (``-1``: base), on the model's
        device; ``None`` when no row uses an adapter."""
        ids = batch.seq_ids[:batch.num_seqs]
        known = len(self._seq_slot)
        per_seq = np.where(ids < known, self._seq_slot[np.minimum(ids, known - 1)], -1)
        if not (per_seq >= 0).any():
            return None
        rows = np.repeat(per_seq, np.diff(batch.query_start_loc[:batch.num_seqs + 1]))
        return torch.from_numpy(rows).to(self.device)
