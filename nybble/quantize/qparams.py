"""Integer grids: per-group (scale, zero) and fake quantization (docs/quant-formats.md §7.1).

Two quantizers:
* ``"gptq"`` min-max (AutoGPTQ ``quantizer.py``): zero forced into the range; ``sym`` uses
  ``zero = 2^(b-1)`` and ``scale = 2*amax / (2^b - 1)``.
* ``"awq"`` min-max (AutoAWQ ``pseudo_quantize_tensor``): asymmetric, range not forced to
  contain 0, ``scale = clamp(max - min, 1e-5) / (2^b - 1)``.
Weights are ``[N, K]`` (``nn.Linear`` layout); parameters are ``[N, G]`` float32, zeros are
integer-valued floats. ``round`` is round-half-to-even (``torch.round``).
"""
from __future__ import annotations

import torch


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N, K] -> [N, G, gs]``; ``group_size == -1`` means one group of K.

    Raises:
        ValueError: K not a multiple of group_size.
    """
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs:
        raise ValueError(f"group_size must be -1 or a positive divisor of K={k}, got {group_size}")
    return w.reshape(n, k // gs, gs)


def minmax_qparams(wmin: torch.Tensor, wmax: torch.Tensor, bits: int, sym: bool,
                   kind: str = "gptq") -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) from per-group minima/maxima (any shape), §7.1.

    The scale is rounded to float16 (the dtype checkpoints store), so the integers are
    computed with exactly the scale that is written.

    Raises:
        ValueError: unknown ``kind``.
    """
    maxq = (1 << bits) - 1
    wmin, wmax = wmin.float(), wmax.float()
    if kind == "awq":
        scale = (torch.clamp(wmax - wmin, min=1e-5) / maxq).half().float()
        zero = torch.clamp(-torch.round(wmin / scale), 0, maxq)
        return scale, zero
    if kind != "gptq":
        raise ValueError(f"kind must be 'gptq' or 'awq', got {kind!r}")
    xmin = torch.minimum(wmin, torch.zeros_like(wmin))
    xmax = torch.maximum(wmax, torch.zeros_like(wmax))
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both0, -torch.ones_like(xmin), xmin)
    xmax = torch.where(both0, torch.ones_like(xmax), xmax)
    scale = ((xmax - xmin) / maxq).half().float()
    zero = (torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale))
    return scale, zero


def get_group_qparams(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                      kind: str = "gptq") -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group) parameters of ``w [N, K]``: ``scale, zero`` float32 ``[N, G]``."""
    g = _grouped(w.float(), group_size)
    return minmax_qparams(g.amin(dim=2), g.amax(dim=2), bits, sym, kind)


def quantize_to_int(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    group_size: int) -> torch.Tensor:
    """``q = clamp(round(w / scale) + zero, 0, 2^b - 1)``: int32 ``[N, K]`` from ``w [N, K]``
    and ``scale, zero [N, G]``."""
    g = _grouped(w.float(), group_size)
    q = torch.clamp(torch.round(g / scale.unsqueeze(2)) + zero.unsqueeze(2), 0, (1 << bits) - 1)
    return q.reshape(w.shape).to(torch.int32)


def dequantize_int(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """``scale * (q - zero)`` float32 ``[N, K]`` (groups of contiguous columns)."""
    g = _grouped(q.float(), group_size)
    return ((g - zero.unsqueeze(2)) * scale.unsqueeze(2)).reshape(q.shape)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                  kind: str = "gptq") -> torch.Tensor:
    """Quantize-dequantize ``w [N, K]`` with its own min-max parameters; returns ``w.dtype``."""
    scale, zero = get_group_qparams(w, bits, group_size, sym, kind)
    return dequantize_int(quantize_to_int(w, scale, zero, bits, group_size), scale, zero,
                          group_size).to(w.dtype)
