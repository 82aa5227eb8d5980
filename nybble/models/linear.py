"""Linear layers as the model sees them, and the factory that quantization plugs into.

Every linear module the model builds comes from a :class:`LinearFactory`. Its parameters are
named exactly as in the checkpoint (``weight``/``bias`` for dense; ``qweight``/``qzeros``/
``scales``/``g_idx`` for GPTQ/AWQ; ``weight_packed``/``weight_scale``... for
compressed-tensors), so loading a fused projection (qkv, gate_up) is: collect each shard's
tensors, concatenate each name along ``output_dims[name]`` (the output-feature axis of that
tensor), and hand the result to :meth:`load_tensors`. Names whose ``output_dims`` entry is
``None`` are shared by all shards (for example ``g_idx``) and must be equal across them.
``input_dims`` (``None``: not split along the input) and ``group_tensors`` say how a
row-parallel rank slices each tensor (:mod:`nybble.models.tp_shard`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from torch import nn


class FusableLinear(Protocol):
    """What the loader needs from a linear module (dense or quantized).

    Attributes:
        output_dims: checkpoint tensor name -> axis holding output features (``None``: shared).
        in_features, out_features: logical widths (``y = x @ W^T``, ``W: [out, in]``).
    """

    output_dims: ClassVar[dict[str, int | None]]
    in_features: int
    out_features: int

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the (already fused) checkpoint tensors of this module."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in] -> [T, out]``."""
        ...


class DenseLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W: [out, in]`` in the model dtype (no quantization)."""

    output_dims: ClassVar[dict[str, int | None]] = {"weight": 0, "bias": 0}
    input_dims: ClassVar[dict[str, int | None]] = {"weight": 1, "bias": None}

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``weight [out, in]`` (and ``bias [out]`` when the layer has one).

        Raises:
            ValueError: a missing tensor or a shape that differs from the layer's.
        """
        for name, param in (("weight", self.weight), ("bias", self.bias)):
            if param is None:
                continue
            if name not in tensors:
                raise ValueError(f"checkpoint lacks {name!r} for a linear layer of shape "
                                 f"[{self.out_features}, {self.in_features}]")
            t = tensors[name]
            if t.shape != param.shape:
                raise ValueError(f"{name} must have shape {tuple(param.shape)}, got "
                                 f"{tuple(t.shape)}")
            param.data.copy_(t.to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, in] -> [T, out]``."""
        return nn.functional.linear(x, self.weight, self.bias)

    def as_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`forward` as a plain callable (no ``nn.Module`` dispatch per call)."""
        return functools.partial(nn.functional.linear, weight=self.weight, bias=self.bias)


def as_function(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward as a plain callable: its ``as_function()`` when it has one (dense
    layers, norms), else its bound ``forward`` (quantized linears)."""
    make = getattr(module, "as_function", None)
    return make() if make is not None else module.forward


class LinearFactory(Protocol):
    """Builds the linear module for one (possibly fused) projection, or says "stay dense".

    ``prefixes`` are the checkpoint module names of the shards in output order, e.g.
    ``["model.layers.0.self_attn.q_proj", "...k_proj", "...v_proj"]``; ``out_features`` the
    matching shard widths. A quantization config (``nybble.quant``, a layer below the models)
    returns None for modules it skips (``modules_to_not_convert``, or tensors stored
    unquantized); :func:`build_linear` then builds the :class:`DenseLinear` itself.
    """

    def __call__(self, prefixes: list[str], in_features: int, out_features: list[int],
                 bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        ...


def dense_linear_factory(prefixes: list[str], in_features: int, out_features: list[int],
                         bias: bool, dtype: torch.dtype, device: torch.device) -> None:
    """The :class:`LinearFactory` of an unquantized model: every projection stays dense."""
    return None


def build_linear(factory: LinearFactory, prefixes: list[str], in_features: int,
                 out_features: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device) -> nn.Module:
    """The module ``factory`` builds, or a :class:`DenseLinear` when it says "stay dense"
    (None); records ``shard_prefixes`` (the checkpoint names the loader fuses) and
    ``shard_widths`` (their output widths)."""
    module = factory(prefixes, in_features, out_features, bias, dtype, device)
    if module is None:
        module = DenseLinear(in_features, sum(out_features), bias, dtype, device)
    module.shard_prefixes = list(prefixes)
    module.shard_widths = list(out_features)
    return module
