"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding, SwiGLU.

Flat-batch convention: activations are ``[T, hidden]`` for the ``T`` new tokens of a step.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in float32 as HF Llama.

    ``y = w * x / sqrt(mean(x^2) + eps)``; ``x: [T, hidden]`` -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise each row of ``x: [T, hidden]``."""
        in_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)


def _rope_config(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., RoFormer 2021) in HF's ``rotate_half`` layout.

    Frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` for scaled variants (``llama3``,
    ``linear``, ``yarn``...), so they match the reference implementation exactly; ``default``
    is ``theta ** (-2i / head_dim)``. A cos/sin table for every position up to
    ``max_positions`` is built once at start-up.

    Raises:
        UnsupportedModelError: a ``rope_type`` transformers does not know, or ``dynamic``
            (its frequencies depend on the sequence length, which a shared cache cannot do).
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int,
                 device: torch.device) -> None:
        super().__init__()
        from nybble.errors import UnsupportedModelError

        params = _rope_config(config)
        rope_type = params["rope_type"]
        scaling = 1.0
        if rope_type == "default":
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** exponent)
        elif rope_type in ROPE_INIT_FUNCTIONS and rope_type != "dynamic":
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        else:
            raise UnsupportedModelError(
                f"rope_type must be one of default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))} "
                f"(not dynamic), got {rope_type!r}")
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]  # (max_positions, head_dim / 2)
        self.register_buffer("cos", (freqs.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [T, heads, head_dim]`` by its token's position (``positions: [T]``)."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]  # (T, 1, head_dim / 2)
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer, 2020): ``x: [T, 2I] -> silu(x[:, :I]) * x[:, I:]``."""
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
