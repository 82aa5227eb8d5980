"""Move a CPU model's streamed weights onto 2 MiB pages (:mod:`nybble.kernels.cpu.huge_pages`).

What moves, in module order (roughly the order a decode step reads them), into one mapping:

* every CPU-packed quantized weight (``QuantLinear.cpu_packed``: the integer-dot and bf16-dot
  kernels' bytes, scales, zeros and minimums; ``cpu_weight``: the weight-only kernel's);
* every float32 parameter or buffer of at least :data:`MIN_TENSOR_BYTES` (dense projections,
  the embedding and a tied or float32 LM head), each once however many modules share it.

Everything else (small tensors, the checkpoint-layout buffers the CPU kernels do not read,
GPU models) stays where it is. ``NYBBLE_CPU_HUGE_PAGES=0`` turns the move off.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import torch
from torch import nn

from nybble.kernels.cpu.huge_pages import huge_page_bytes, huge_page_copy, thp_mode

logger = logging.getLogger(__name__)

MIN_TENSOR_BYTES = 1 << 20
"""Float32 tensors from this size move (smaller ones are norms and biases: read from cache)."""

_PACKED_FIELDS = {"cpu_packed": ("packed", "scales", "zq", "mo"),
                  "cpu_weight": ("packed", "scales", "zeros", "mins")}


def huge_pages_enabled() -> bool:
    """False when ``NYBBLE_CPU_HUGE_PAGES=0`` or the kernel's THP mode is ``never``."""
    return os.environ.get("NYBBLE_CPU_HUGE_PAGES", "1") != "0" and thp_mode() != "never"


def place_weights_on_huge_pages(model: nn.Module, min_tensor_bytes: int = MIN_TENSOR_BYTES
                                ) -> tuple[int, int]:
    """Copy ``model``'s streamed CPU weights into one huge-page mapping and point the modules
    at the copies (values unchanged, bit for bit).

    Call before anything keeps raw pointers to the weights (the fused C decode step).

    Args:
        model: a model whose weights live on the CPU (others are left alone).
        min_tensor_bytes: float32 tensors from this size move.

    Returns:
        ``(bytes moved, bytes the kernel backs with huge pages now)``; ``(0, 0)`` when
        :func:`huge_pages_enabled` is False or nothing qualifies.
    """
    if not huge_pages_enabled():
        return 0, 0
    packed: list[tuple[nn.Module, str, list[str]]] = []   # (module, attribute, its fields)
    arrays: list[np.ndarray] = []
    for module in model.modules():
        for attr, fields in _PACKED_FIELDS.items():
            obj = getattr(module, attr, None)
            if obj is None or not dataclasses.is_dataclass(obj):
                continue
            present = [f for f in fields if isinstance(getattr(obj, f, None), np.ndarray)]
            packed.append((module, attr, present))
            arrays += [getattr(obj, f) for f in present]
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if (t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
                or t.numel() * 4 < min_tensor_bytes or t.data_ptr() in seen):
            continue
        seen.add(t.data_ptr())
        tensors.append(t)
    if not arrays and not tensors:
        return 0, 0
    copies = huge_page_copy(arrays + [t.detach().numpy() for t in tensors])
    it = iter(copies)
    for module, attr, present in packed:
        new = {f: next(it) for f in present}
        setattr(module, attr, dataclasses.replace(getattr(module, attr), **new))
    with torch.no_grad():
        for t, copy in zip(tensors, copies[len(arrays):]):
            t.data = torch.from_numpy(copy)
    moved = sum(c.nbytes for c in copies)
    return moved, min(moved, huge_page_bytes(copies))
