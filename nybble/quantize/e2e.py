"""End-to-end tuning of the group scales of an already quantized model (``gptq-e2e``).

Source: EfficientQAT's "E2E-QP" stage (Chen et al. 2024, arXiv 2407.11062, §3.3): with the
integer weights frozen, train only the quantization step sizes (our per-group scales) through
the whole network. Here the objective is the KL divergence from the fp32 model's next-token
distribution to the quantized model's on the calibration sequences (distillation, so the
quantized model is pulled toward the model it approximates rather than toward the
calibration text), and the scales are parameterized as ``scale = scale0 * exp(theta)``
(always positive, updates relative to the scale's size).

With ``norms`` the RMSNorm weights (stored unquantized, and already rewritten by AWQ-style
methods) are tuned with the scales: they rescale the activations every quantized layer sees.
The integers and zero points stay those of GPTQ, so the result is an ordinary GPTQ checkpoint
with different fp16 scales (and norm weights). Deterministic: full sequences in a fixed cyclic
order, Adam with fixed settings, no randomness; the caller pins the thread count.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nybble.quantize.gptq import GPTQResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneOptions:
    """``steps`` Adam steps of ``batch`` calibration sequences each, learning rate ``lr`` on
    ``theta`` (log-scale units) and on the norm weights when ``norms``."""

    steps: int = 120
    batch: int = 4
    lr: float = 2e-3
    norms: bool = True


class _ScaledIntLinear(nn.Module):
    """``y = x @ (scale[:, g] * (q - zero[:, g]))^T`` with trainable log-scales ``theta [N, G]``."""

    def __init__(self, res: GPTQResult) -> None:
        super().__init__()
        g = res.g_idx.long()
        self.register_buffer("g", g)
        self.register_buffer("qz", res.q.float() - res.zero[:, g])
        self.register_buffer("scale0", res.scale.half().float())
        self.theta = nn.Parameter(torch.zeros_like(self.scale0))

    def scale(self) -> torch.Tensor:
        """Current scales ``[N, G]`` float32."""
        return self.scale0 * torch.exp(self.theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.scale()[:, self.g] * self.qz)


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), nats."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def tune_scales(teacher: nn.Module, student: nn.Module, results: dict[str, GPTQResult],
                ids: torch.Tensor, opts: TuneOptions) -> tuple[dict[str, GPTQResult],
                                                               list[float]]:
    """Tune the scales of ``results`` (Linears of ``student`` by name) end to end.

    Args:
        teacher: the fp32 causal LM. student: the same architecture whose quantized Linears
            (``results``' names) are swapped for trainable modules during the run and
            restored, with their final dequantized weights, afterwards.
        ids: int64 ``[S, L]`` calibration sequences.

    Returns:
        ``(results with tuned fp16-rounded scales and dequant, loss per step)``.

    Raises:
        ValueError: ``opts`` with steps < 0, batch < 1 or lr <= 0.
    """
    if opts.steps < 0 or opts.batch < 1 or opts.lr <= 0:
        raise ValueError(f"tuning needs steps >= 0, batch >= 1 and lr > 0, got {opts}")
    frozen = [p for p in student.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    originals: dict[str, nn.Module] = {}
    mods: dict[str, _ScaledIntLinear] = {}
    for name, res in results.items():
        parent, _, child = name.rpartition(".")
        originals[name] = student.get_submodule(name)
        mods[name] = _ScaledIntLinear(res)
        setattr(student.get_submodule(parent), child, mods[name])
    grad_was = torch.is_grad_enabled()
    params = [m.theta for m in mods.values()]
    if opts.norms:
        norms = [m.weight for m in student.modules() if type(m).__name__.endswith("RMSNorm")]
        for p in norms:
            p.requires_grad_(True)
        params += norms
    opt = torch.optim.Adam(params, lr=opts.lr)
    losses: list[float] = []
    n = ids.shape[0]
    try:
        torch.set_grad_enabled(True)
        for step in range(opts.steps):
            batch = ids[[(step * opts.batch + i) % n for i in range(min(opts.batch, n))]]
            with torch.no_grad():
                target = teacher(input_ids=batch, use_cache=False).logits
            loss = _kl(target, student(input_ids=batch, use_cache=False).logits)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if step % 20 == 0 or step == opts.steps - 1:
                logger.info("scale tuning step %d/%d: KL %.5f", step + 1, opts.steps, losses[-1])
    finally:
        torch.set_grad_enabled(grad_was)
        for name, orig in originals.items():
            parent, _, child = name.rpartition(".")
            setattr(student.get_submodule(parent), child, orig)
        for p in student.parameters():
            p.requires_grad_(False)
        for p in frozen:
            p.requires_grad_(True)
    out: dict[str, GPTQResult] = {}
    with torch.no_grad():
        for name, res in results.items():
            m = mods[name]
            scale = m.scale().half().float()  # what the checkpoint stores
            deq = scale[:, m.g] * m.qz
            originals[name].weight.data.copy_(deq.to(originals[name].weight.dtype))
            out[name] = GPTQResult(res.q, scale, res.zero, res.g_idx, deq)
    return out, losses
