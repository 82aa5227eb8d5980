"""Mixture-of-experts models (Qwen3-MoE, Mixtral) in the quantizer: one ``nn.Linear`` per
expert projection, named as in the checkpoint.

transformers 5 holds a sparse block's experts as two stacked parameters (``gate_up_proj
[E, 2I, H]``, ``down_proj [E, H, I]``), which the layer-by-layer quantizer cannot hook or
replace, while checkpoints store every expert's projections apart
(``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's ``w1`` / ``w3`` / ``w2``
under ``block_sparse_moe`` instead of ``mlp``). :func:`unfuse_experts` swaps each stacked
module for :class:`ExpertLinears`, which computes the same thing with one ``nn.Linear`` per
projection: the calibration hooks then see exactly the tokens routed to each expert (GPTQ's
Hessian per expert), every projection is quantized like a dense layer's and written in the
same packed format, and :func:`checkpoint_name` / :func:`model_name` translate between the
model's module names and the checkpoint's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nybble.kernels.reference.moe import grouped_experts

_BLOCK_NAMES = {"mixtral": "block_sparse_moe"}
"""model_type -> the sparse block's checkpoint name where transformers calls it ``mlp``."""
_PROJECTIONS = {"mixtral": ("w1", "w3", "w2")}
"""model_type -> an expert's gate, up and down checkpoint names (default: ``gate_proj``,
``up_proj``, ``down_proj``)."""
DOWN_NAMES = ("down_proj", "w2")
"""The down projection's name in each family (the second GPTQ sub-group of an MoE block)."""


class ExpertLinears(nn.Module):
    """A sparse block's experts as ``nn.Linear`` per projection: child ``str(e)`` of expert
    ``e`` holds its gate, up and down linears under the checkpoint's names.

    ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` is
    transformers' experts forward: each expert on its routed tokens, ``act(gate) * up`` then
    down, times the routing weight, summed into the tokens (``index_add``, expert by expert).
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, names: tuple[str, str, str],
                 act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.names, self.act = num_experts, names, act
        for e in range(num_experts):
            expert = nn.Module()
            for name, (n_in, n_out) in zip(names, ((hidden, inter), (hidden, inter),
                                                   (inter, hidden))):
                expert.add_module(name, nn.Linear(n_in, n_out, bias=False, dtype=dtype))
            self.add_module(str(e), expert)

    @classmethod
    def of(cls, stacked: nn.Module, names: tuple[str, str, str]) -> ExpertLinears:
        """The per-projection copy of transformers' stacked experts module ``stacked``."""
        num, two_inter, hidden = stacked.gate_up_proj.shape
        inter = two_inter // 2
        out = cls(num, hidden, inter, names, stacked.act_fn, stacked.gate_up_proj.dtype)
        gate, up, down = names
        with torch.no_grad():
            for e in range(num):
                expert = out.get_submodule(str(e))
                getattr(expert, gate).weight.copy_(stacked.gate_up_proj[e, :inter])
                getattr(expert, up).weight.copy_(stacked.gate_up_proj[e, inter:])
                getattr(expert, down).weight.copy_(stacked.down_proj[e])
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, H]`` (see the class)."""
        gate, up, down = self.names

        def expert(e: int, x: torch.Tensor) -> torch.Tensor:
            m = self.get_submodule(str(e))
            return getattr(m, down)(self.act(getattr(m, gate)(x)) * getattr(m, up)(x))
        return grouped_experts(hidden_states, top_k_weights, top_k_index, self.num_experts,
                               expert)


def _model_type(hf_config: dict[str, Any]) -> str:
    return str(hf_config.get("model_type", ""))


def unfuse_experts(model: nn.Module, hf_config: dict[str, Any]) -> int:
    """Replace every stacked experts module of ``model`` (``layers[i].mlp.experts`` with
    ``gate_up_proj`` / ``down_proj`` parameters) by :class:`ExpertLinears`; the number
    replaced (0 for a dense model)."""
    names = _PROJECTIONS.get(_model_type(hf_config), ("gate_proj", "up_proj", "down_proj"))
    replaced = 0
    for layer in model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None and isinstance(getattr(experts, "gate_up_proj", None),
                                              torch.Tensor):
            layer.mlp.experts = ExpertLinears.of(experts, names)
            replaced += 1
    return replaced


def checkpoint_name(hf_config: dict[str, Any]) -> Callable[[str], str]:
    """The function from the model's tensor / module names to the checkpoint's
    (``model.layers.3.mlp.experts.0.w1`` -> ``model.layers.3.block_sparse_moe.experts.0.w1``
    for Mixtral; the identity for the other families)."""
    block = _BLOCK_NAMES.get(_model_type(hf_config))
    if block is None:
        return _same
    return lambda name: _swap(name, ".mlp.", f".{block}.")


def model_name(hf_config: dict[str, Any]) -> Callable[[str], str]:
    """The inverse of :func:`checkpoint_name`."""
    block = _BLOCK_NAMES.get(_model_type(hf_config))
    if block is None:
        return _same
    return lambda name: _swap(name, f".{block}.", ".mlp.")


def _same(name: str) -> str:
    return name


def _swap(name: str, old: str, new: str) -> str:
    """``name`` with its first ``old`` after ``model.layers.N`` replaced by ``new``."""
    if not name.startswith("model.layers."):
        return name
    head, _, rest = name.partition("model.layers.")[2].partition(".")
    rest = "." + rest
    return f"model.layers.{head}{new}{rest[len(old):]}" if rest.startswith(old) else name
