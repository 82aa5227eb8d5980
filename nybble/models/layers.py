"""Building blocks of the decoders: RMSNorm (and Gemma's ``(1 + w)`` form), rotary embedding
(full or partial), SwiGLU and GELU-tanh gated MLP activations.

Flat-batch convention: activations are ``[T, hidden]`` for the ``T`` new tokens of a step.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nybble.errors import UnsupportedModelError


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
        self.normalized_shape = (hidden_size,)

    def as_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`forward` as a plain callable for activations of the weight's dtype (no
        ``nn.Module`` dispatch per call)."""
        if self.weight.dtype == torch.float32:
            return functools.partial(torch.rms_norm, normalized_shape=self.normalized_shape,
                                     weight=self.weight, eps=self.eps)
        return self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise each row of ``x: [T, hidden]``."""
        if x.dtype == torch.float32:
            # NOTE: one fused op; in float32 it computes HF's operations bit for bit (tested).
            return torch.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``y = (1 + w) * x / sqrt(mean(x^2) + eps)``, computed in float32 and
    cast back (transformers' ``Gemma2RMSNorm``; the checkpoint stores ``w``, zero-centred).

    ``x: [..., hidden]`` -> same shape and dtype.
    """

    def as_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`forward` as a plain callable, ``1 + w`` taken once (call it after the
        weights are loaded)."""
        if self.weight.dtype == torch.float32:
            return functools.partial(torch.rms_norm, normalized_shape=self.normalized_shape,
                                     weight=1.0 + self.weight, eps=self.eps)
        return self.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise each row of ``x`` over its last dimension."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def _rope_config(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies ``theta ** (-2i / head_dim)``, ``[head_dim / 2]`` float32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta ** exponent)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling (Meta's reference ``apply_scaling``): wavelengths longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    shorter than ``... / high_freq_factor`` kept, and those between interpolated smoothly."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[P, 2, 2 * F]`` float32 rows ``([c, c], [-s, s]) * scaling`` of ``pos [P]`` for
    ``inv_freq [F]``."""
    freqs = pos[:, None] * inv_freq.float()[None, :]
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), 1)


def _transformers_inv_freq(config: Any, rope_type: str, seq_len: int | None = None
                           ) -> tuple[torch.Tensor, float]:
    """Frequencies of the rarer scaled types (``yarn``, ``longrope``...) from transformers
    (imported only for such a model); ``seq_len``: the sequence length they are for (LongRoPE
    picks its long factors past the original length)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise UnsupportedModelError(
            f"rope_type must be one of default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))} "
            f"(not dynamic), got {rope_type!r}")
    raw = dict(getattr(config, "raw", None) or config.to_dict())
    hf = AutoConfig.for_model(raw.pop("model_type", "llama"), **raw)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len)
    return inv_freq, float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., RoFormer 2021) in HF's ``rotate_half`` layout.

    Frequencies: ``default`` is ``theta ** (-2i / head_dim)``; ``linear`` divides them by
    ``factor``; ``llama3`` is Llama 3.1's scaling (:func:`llama3_inv_freq`); other scaled
    types (``yarn``, ``longrope``...) come from transformers' ``ROPE_INIT_FUNCTIONS``. Tests
    compare all of them with transformers. ``partial_rotary_factor`` < 1 (Phi-4-mini) rotates
    only the first ``int(head_dim * factor)`` dimensions of each head. A cos/sin table for
    every position up to ``max_positions`` is built once at start-up, in the full-width form ``cos = [c, c]``,
    ``sin = [-s, s]`` so that a rotation is ``x * cos + roll(x) * sin`` (``roll`` swaps the
    halves): the products HF's ``rotate_half`` form computes, bit for bit. :meth:`lookup`
    gathers a step's rows once; every layer's :meth:`apply` reuses them.

    Raises:
        UnsupportedModelError: a ``rope_type`` transformers does not know, or ``dynamic``
            (its frequencies depend on the sequence length, which a shared cache cannot do).
    """

    def __init__(self, config: Any, head_dim: int, max_positions: int,
                 device: torch.device, params: dict | None = None) -> None:
        """``params``: this table's RoPE parameters when a model has several (Gemma 3's local
        and global layers); default: the config's."""
        super().__init__()
        params = dict(params) if params is not None else _rope_config(config)
        params.setdefault("rope_type", params.get("type", "default"))
        rope_type = params["rope_type"]
        factor = float(params.get("partial_rotary_factor",
                                  getattr(config, "partial_rotary_factor", 1.0) or 1.0))
        rotary_dim = int(head_dim * factor)
        pos = torch.arange(max_positions, dtype=torch.float32)
        if rope_type in ("default", "linear", "llama3"):
            inv_freq = default_inv_freq(params["rope_theta"], rotary_dim)
            if rope_type == "linear":
                inv_freq = inv_freq / params["factor"]
            elif rope_type == "llama3":
                inv_freq = llama3_inv_freq(inv_freq, params)
            table = _cos_sin(pos, inv_freq, 1.0)
        else:
            inv_freq, scaling = _transformers_inv_freq(config, rope_type)
            table = _cos_sin(pos, inv_freq, scaling)
            original = int(params.get("original_max_position_embeddings") or max_positions)
            if rope_type == "longrope" and max_positions > original:
                # NOTE: LongRoPE's long factors for the positions past the original length
                # (vLLM's Phi3LongRoPE table); transformers switches a whole sequence to them
                # once it grows past that length, which a shared cache cannot do.
                long_freq, scaling = _transformers_inv_freq(config, rope_type, original + 1)
                table[original:] = _cos_sin(pos[original:], long_freq, scaling)
        self.register_buffer("cos_sin", table.to(device), persistent=False)  # (P, 2, rotary)
        self.half = rotary_dim // 2
        self.rotary_dim = rotary_dim
        self.partial = rotary_dim < head_dim

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, 1, rotary_dim]`` in ``dtype``, for ``positions: [T]``."""
        rows = self.cos_sin.index_select(0, positions).to(dtype)  # (T, 2, head_dim)
        return rows[:, 0:1], rows[:, 1:2]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [T, heads, head_dim]`` by :meth:`lookup`'s ``cos``/``sin``; a new
        contiguous tensor (the dimensions past ``rotary_dim`` pass through)."""
        if self.partial:
            rot = x[..., :self.rotary_dim]
            rot = rot * cos + torch.roll(rot, self.half, -1) * sin
            return torch.cat((rot, x[..., self.rotary_dim:]), -1)
        return x * cos + torch.roll(x, self.half, -1) * sin

    def unapply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`apply` (a rotation by the opposite angle): ``x [T, heads,
        head_dim]`` rotated at the positions of ``cos``/``sin`` -> ``x`` before RoPE, a new
        tensor. Full-width tables only.

        Raises:
            ValueError: a partial rotary embedding.
        """
        if self.partial:
            raise ValueError("unapply needs a full-width rotary embedding "
                             "(partial_rotary_factor 1)")
        return x * cos - torch.roll(x, self.half, -1) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation (Shazeer, 2020): ``x: [T, 2I] -> silu(x[:, :I]) * x[:, I:]``
    (a new contiguous tensor)."""
    half = x.shape[-1] // 2
    return nn.functional.silu(x[..., :half]).mul_(x[..., half:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU (Shazeer, 2020; Gemma's ``gelu_pytorch_tanh``):
    ``x: [T, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:]`` (a new contiguous tensor)."""
    half = x.shape[-1] // 2
    return nn.functional.gelu(x[..., :half], approximate="tanh").mul_(x[..., half:])


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
"""Config ``hidden_act`` / ``hidden_activation`` -> the gated activation of the fused
``[T, 2I]`` gate/up output."""
