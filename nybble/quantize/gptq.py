"""GPTQ for one Linear (Frantar et al. 2023, arXiv 2210.17323; docs/quant-formats.md §7.3).

:class:`HessianAccumulator` collects ``H = (2/n) sum x x^T`` from calibration inputs;
:func:`gptq_quantize` runs ``fasterquant``: dead-input handling, optional static groups and
act-order, dampening, inverse-Hessian upper Cholesky factor, blockwise column quantization
with error feedback, lazy batch updates, and ``g_idx``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nybble.quantize.qparams import minmax_qparams


class HessianAccumulator:
    """Running ``H [K, K]`` float32 of one Linear's inputs (§7.3 "Hessian accumulation")."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.n = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """Add ``x [B, T, K]`` (or ``[T, K]``, one sequence); the count is in sequences."""
        b = x.shape[0] if x.dim() == 3 else 1
        xf = x.reshape(-1, x.shape[-1]).float()
        self.h *= self.n / (self.n + b)
        self.n += b
        xf = xf * (2.0 / self.n) ** 0.5
        self.h += xf.t() @ xf


@dataclass
class GPTQResult:
    """``q int32 [N, K]`` (original column order), ``scale, zero float32 [N, G]`` in group
    order, ``g_idx int32 [K]``, ``dequant float32 [N, K]``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor
    dequant: torch.Tensor


def _qparams(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return minmax_qparams(w.amin(dim=1), w.amax(dim=1), bits, sym)


def gptq_quantize(weight: torch.Tensor, h: torch.Tensor, bits: int, group_size: int,
                  sym: bool, desc_act: bool = False, static_groups: bool = False,
                  percdamp: float = 0.01, blocksize: int = 128) -> GPTQResult:
    """Quantize ``weight [N, K]`` given the input Hessian ``h [K, K]`` (§7.3 fasterquant).

    Args:
        bits: 4 or 8. group_size: -1 (per channel) or a divisor of K.
        sym: symmetric grid. desc_act: act-order. static_groups: groups fixed up front.
        percdamp: dampening fraction of ``mean(diag(H))``. blocksize: lazy-update block.

    Raises:
        ValueError: K not a multiple of group_size. torch.linalg.LinAlgError: H not PD even
            after dampening (retried with growing dampening up to 10 times first).
    """
    w = weight.detach().clone().float()
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group_size must divide K={k}, got {group_size}")
    maxq = (1 << bits) - 1
    h = h.detach().clone().float()
    full = _qparams(w, bits, sym) if group_size == -1 else None
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    static: list[tuple[torch.Tensor, torch.Tensor]] = []
    if static_groups and group_size != -1:
        static = [_qparams(w[:, i:i + gs], bits, sym) for i in range(0, k, gs)]
    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    damp = percdamp * torch.mean(torch.diag(h))
    idx = torch.arange(k)
    # Frantar et al. §3 step 3, "Cholesky reformulation": quantizing column j and compensating
    # on the columns after it needs row j of H_F^-1, the inverse Hessian of the columns not yet
    # quantized, over its diagonal. The upper Cholesky factor U of H^-1 holds exactly these:
    # U[j, j:] = H_F^-1[j, j:] / sqrt(H_F^-1[j, j]) (Cholesky performs the same sequential
    # elimination), so one factorization replaces K rank-1 downdates of H^-1. Dampening keeps
    # H positive definite.
    for attempt in range(10):
        try:
            hd = h.clone()
            hd[idx, idx] += damp * (attempt + 1)
            u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)),
                                      upper=True)
            break
        except torch.linalg.LinAlgError:
            if attempt == 9:
                raise
    qcols = torch.zeros_like(w)
    qint = torch.zeros(n, k, dtype=torch.int32)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    scale, zero = full if full is not None else (None, None)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            j = i1 + i
            if group_size != -1:
                if static:
                    scale, zero = static[int(perm[j]) // gs]
                elif j % gs == 0:
                    scale, zero = _qparams(w[:, j:j + gs], bits, sym)
                    scales.append(scale)
                    zeros.append(zero)
            assert scale is not None and zero is not None
            col = w1[:, i]
            q = torch.clamp(torch.round(col / scale) + zero, 0, maxq)
            deq = scale * (q - zero)
            qint[:, j] = q.to(torch.int32)
            qcols[:, j] = deq
            # Error feedback (the OBQ update, Frantar et al. eq. 2): the not-yet-quantized
            # columns move by -(w_j - q_j) / H_F^-1[j, j] * H_F^-1[j, :], the change that
            # minimises the growth of the layer's output error ||XW^T - XQ^T||^2 (GPTQ's
            # objective) caused by rounding column j. With U's row that is err * U[j, j:].
            err = (col - deq) / u[j, j]
            w1[:, i:] -= err.unsqueeze(1) * u[j, i1 + i:i2].unsqueeze(0)  # inside the block
            err1[:, i] = err
        # §3 step 2, "lazy batch-updates": the columns after this block receive the whole
        # block's error feedback in one matmul instead of one rank-1 update per column.
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    inv = torch.argsort(perm)
    if group_size == -1:
        assert full is not None
        scales, zeros = [full[0]], [full[1]]
        g_idx = torch.zeros(k, dtype=torch.int32)
    elif static:
        scales, zeros = [s for s, _ in static], [z for _, z in static]
        g_idx = (torch.arange(k) // gs).to(torch.int32)
    else:
        g_idx = (inv // gs).to(torch.int32) if desc_act else (torch.arange(k) // gs).to(
            torch.int32)
    return GPTQResult(qint[:, inv], torch.stack(scales, 1), torch.stack(zeros, 1), g_idx,
                      qcols[:, inv])
