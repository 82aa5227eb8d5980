"""Round-to-nearest baseline (docs/quant-formats.md §7.2): per-group min/max, no calibration."""
from __future__ import annotations

import torch

from nybble.quantize.gptq import GPTQResult
from nybble.quantize.qparams import dequantize_int, get_group_qparams, quantize_to_int


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                 kind: str = "gptq") -> GPTQResult:
    """Quantize ``weight [N, K]`` group by group: ``kind="gptq"`` min-max (asym, or absmax when
    ``sym``) or ``kind="awq"`` (asym, range not forced through 0).

    Returns:
        :class:`GPTQResult` with trivial ``g_idx = k // group_size``.
    """
    k = weight.shape[1]
    scale, zero = get_group_qparams(weight, bits, group_size, sym, kind)
    q = quantize_to_int(weight, scale, zero, bits, group_size)
    gs = k if group_size == -1 else group_size
    g_idx = (torch.arange(k) // gs).to(torch.int32)
    return GPTQResult(q, scale, zero, g_idx, dequantize_int(q, scale, zero, group_size))
