"""Batched multi-LoRA: one mixed batch, each token row under its own adapter (or none).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") adds to a frozen
projection ``y = x W^T`` a low-rank update ``y += scale * (x A^T) B^T`` with ``A: [r, in]``,
``B: [out, r]``. Serving many adapters over one base (S-LoRA, Sheng et al. 2023; Punica, Chen
et al. 2023) keeps every adapter that a running request uses in a *slot* of stacked tensors,
zero-padded to the largest rank ``R``:

* ``lora_a [S, R, in]`` and ``lora_b [S, out, R]``, in the model dtype, with the adapter's
  scale (``alpha / r``, or rsLoRA's ``alpha / sqrt(r)``) already multiplied into ``lora_b``;
* ``token_slots [T]`` int64: the slot of each token row, ``-1`` for the base model.

Each step then adds every row's update with a fixed number of tensor ops (no loop over
requests or adapters): *shrink* ``h = x A_s^T`` (``[T, R]``), then *expand* ``y += h B_s^T``.
Zero-padded rank rows contribute exactly zero, so a rank-8 adapter in a rank-16 slot is exact.

Two equivalent ways, chosen by size (both checked against :func:`add_lora_reference`):

* :func:`add_lora_gathered` (Punica's BGMV): gather each row's ``A`` and ``B`` and use
  ``bmm``: ``T * R * (in + out)`` weight elements are read per call, cheap for a few rows
  (decode steps);
* :func:`add_lora_stacked`: shrink every row through every slot at once
  (``x @ A_all^T``, ``[T, S * R]``), zero the columns of the slots a row does not use, and
  expand through all slots with one GEMM; no per-row weight copies, ``S`` times the flops of
  one adapter, the better choice for prefill-sized batches.

On CUDA, :func:`add_lora` runs the Triton kernels of :mod:`nybble.kernels.triton.lora`
(Punica's BGMV: one program per row and output tile, reading only its slot's weights; imported
lazily, so CPU installs never import Triton).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GATHER_MAX_ROWS = 16
"""Batches of at most this many rows (and fewer than 4 per slot) take the gathered path."""


@dataclass(frozen=True, slots=True)
class LoRARows:
    """A step's row-to-slot map, prepared once and read by every adapted projection.

    Attributes:
        token_slots: ``[T]`` int64 slot of each row, ``-1``: base.
        gathered: the step takes the gathered path (few rows).
        index: ``[T]`` int64 slot with base rows at 0 (gathered path; their update is
            zeroed by ``keep``).
        keep: ``[T, 1, 1]`` 1 for adapter rows, 0 for base rows (gathered path).
        own: ``[T, S, 1]`` one-hot of each row's slot, all 0 for base rows (stacked path).
    """

    token_slots: torch.Tensor
    gathered: bool
    index: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    own: torch.Tensor | None = None

    @classmethod
    def of(cls, token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype,
           gathered: bool | None = None) -> LoRARows:
        """Prepare ``token_slots`` (``[T]`` int64, ``-1``: base) for ``num_slots`` slots and
        activations of ``dtype``; ``gathered``: force a path (default: by size)."""
        rows = token_slots.shape[0]
        if gathered is None:
            gathered = rows <= GATHER_MAX_ROWS and rows < 4 * num_slots
        if gathered:
            return cls(token_slots, True, index=token_slots.clamp(min=0),
                       keep=(token_slots >= 0).to(dtype).view(-1, 1, 1))
        slots = torch.arange(num_slots, device=token_slots.device)
        return cls(token_slots, False,
                   own=(token_slots.unsqueeze(1) == slots).to(dtype).unsqueeze(-1))


def _check(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           token_slots: torch.Tensor) -> None:
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[:2] != (lora_b.shape[0],
                                                                     lora_b.shape[2]):
        raise ValueError(f"lora_a must be [S, R, in] and lora_b [S, out, R], got "
                         f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    if x.shape[-1] != lora_a.shape[2] or y.shape[-1] != lora_b.shape[1] or \
            x.shape[0] != y.shape[0] or token_slots.shape != (x.shape[0],):
        raise ValueError(f"x must be [T, {lora_a.shape[2]}], y [T, {lora_b.shape[1]}] and "
                         f"token_slots [T], got {tuple(x.shape)}, {tuple(y.shape)} and "
                         f"{tuple(token_slots.shape)}")


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                       lora_b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The definition, row by row (tests only): ``y[t] += B_s (A_s x[t])`` for
    ``s = token_slots[t] >= 0``; returns ``y`` (updated in place)."""
    _check(y, x, lora_a, lora_b, token_slots)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            y[t] += lora_b[s] @ (lora_a[s] @ x[t])
    return y


def add_lora_gathered(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """Per-row gather of each row's slot, then two ``bmm`` (BGMV). Shapes and result as
    :func:`add_lora`; ``rows`` prepared with ``gathered`` set."""
    assert rows.index is not None and rows.keep is not None
    h = torch.bmm(lora_a.index_select(0, rows.index), x.unsqueeze(-1))    # (T, R, 1)
    h.mul_(rows.keep)                                                     # base rows: zero
    y += torch.bmm(lora_b.index_select(0, rows.index), h).squeeze(-1)     # (T, out)
    return y


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """Shrink through every slot, mask the other slots' columns, expand through every slot
    (two GEMMs). Shapes and result as :func:`add_lora`; ``rows`` prepared without
    ``gathered``."""
    assert rows.own is not None
    num_slots, rank, width = lora_a.shape
    h = x @ lora_a.reshape(num_slots * rank, width).t()                  # (T, S * R)
    h = h.view(-1, num_slots, rank).mul_(rows.own)
    # NOTE: a free view when lora_b is the transpose of an [S, R, out] tensor (LoRASlots)
    y += h.view(-1, num_slots * rank) @ lora_b.transpose(1, 2).reshape(num_slots * rank, -1)
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             rows: LoRARows | torch.Tensor) -> torch.Tensor:
    """Add each token row's LoRA update to the base projection's output, in place.

    Args:
        y: ``[T, out]`` the base projection's output (updated in place and returned).
        x: ``[T, in]`` the projection's input, in ``y``'s dtype.
        lora_a: ``[S, R, in]`` stacked down-projections of the ``S`` slots (ranks zero-padded
            to ``R``).
        lora_b: ``[S, out, R]`` stacked up-projections, each already times its adapter's
            scale.
        rows: the step's :class:`LoRARows` (prepared once per step), or ``token_slots``
            itself: ``[T]`` int64 slot of each row, ``-1`` for the base model (nothing added).

    Returns:
        ``y``, where ``y[t] += lora_b[s] @ lora_a[s] @ x[t]`` for ``s = token_slots[t] >= 0``.

    Raises:
        ValueError: shapes that do not fit together.
    """
    if isinstance(rows, torch.Tensor):
        rows = LoRARows.of(rows, lora_a.shape[0], x.dtype)
    _check(y, x, lora_a, lora_b, rows.token_slots)
    if x.device.type == "cuda":
        from nybble.kernels.triton import lora as triton_lora

        return triton_lora.add_lora(y, x, lora_a, lora_b, rows.token_slots)
    if rows.gathered:
        return add_lora_gathered(y, x, lora_a, lora_b, rows)
    return add_lora_stacked(y, x, lora_a, lora_b, rows)
