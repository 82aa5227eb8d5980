"""Quantize the Linears of one decoder layer with each method (docs/quant-formats.md §7).

Every function takes the layer, its recorded input ``hidden [S, L, H]`` and forward keyword
arguments, the names of the Linears to quantize, and the options; it replaces each Linear's
weight by its dequantized result and returns, per Linear, the :class:`GPTQResult` to pack, the
weight it approximates and ``H = X^T X`` of the calibration inputs it saw (for the report's
output error), plus the next layer's input: the quantized layer's output for GPTQ, the
original output for AWQ and RTN (AWQ does not feed quantized activations forward, §7.4).

Methods:
* ``rtn``: round to nearest, no calibration (the inputs only feed the error report).
* ``gptq``: Frantar et al. 2023 (arXiv 2210.17323), AutoGPTQ's true-sequential sub-groups;
  in a mixture-of-experts layer each expert's projections get the Hessian of the tokens
  routed to it (an expert that received none is rounded to nearest, with a warning).
* ``awq``: Lin et al. 2024 (arXiv 2306.00978) as AutoAWQ runs it (scaling groups, the scale
  search on each block's output, clipping of all but q/k, its min-max grid), with two
  searches widened (:mod:`nybble.quantize.awq`): both scale formulas, and clipping ranges
  whose ends shrink independently.
* ``gptq-e2e``: GPTQ layer by layer, then the group scales tuned end to end
  (:mod:`nybble.quantize.e2e`, run by the driver).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from nybble.quantize import awq as awq_mod
from nybble.quantize.calibration import attention_forward, record_inputs, run_layer
from nybble.quantize.gptq import GPTQResult, HessianAccumulator, gptq_quantize
from nybble.quantize.moe_experts import DOWN_NAMES, ExpertLinears
from nybble.quantize.rtn import rtn_quantize

logger = logging.getLogger(__name__)

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
GPTQ_SUBGROUPS = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                  ["self_attn.o_proj"], ["mlp.up_proj", "mlp.gate_proj"], ["mlp.down_proj"]]
"""AutoGPTQ's Llama order (§7.3 "Driver")."""


def layer_linears(layer: nn.Module) -> list[str]:
    """The Linears of ``layer`` to quantize, relative to it: :data:`LINEARS`, or for a sparse
    mixture-of-experts layer (:class:`~nybble.quantize.moe_experts.ExpertLinears`) the
    attention's four and every expert's gate, up and down (``mlp.experts.{e}.{name}``)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if not isinstance(experts, ExpertLinears):
        return list(LINEARS)
    return LINEARS[:4] + [f"mlp.experts.{e}.{n}" for e in range(experts.num_experts)
                          for n in experts.names]


def gptq_subgroups(names: list[str]) -> list[list[str]]:
    """GPTQ's sub-groups for ``names`` (:data:`GPTQ_SUBGROUPS`; a sparse MoE layer: q/k/v,
    o, every expert's gate and up, every expert's down)."""
    if not any(".experts." in n for n in names):
        return GPTQ_SUBGROUPS
    moe = [n for n in names if ".experts." in n]
    return [*GPTQ_SUBGROUPS[:2], [n for n in moe if n.rpartition(".")[2] not in DOWN_NAMES],
            [n for n in moe if n.rpartition(".")[2] in DOWN_NAMES]]


@dataclass(frozen=True)
class LayerOptions:
    """What the per-layer functions need from :class:`nybble.quantize.driver.QuantizeOptions`."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    static_groups: bool
    damp_percent: float
    duo_scaling: bool | str
    clip: bool

    def for_width(self, in_features: int) -> "LayerOptions":
        """These options for a Linear of ``in_features`` inputs: the group size replaced by
        :func:`group_size_for` when it does not divide the width (unchanged otherwise)."""
        gs = group_size_for(in_features, self.group_size)
        return self if gs in (None, self.group_size) else replace(self, group_size=gs)


GROUP_MULTIPLE = 8
"""A fallback group size is a multiple of this (the CPU kernels' 4-bit packing unit)."""


def group_size_for(in_features: int, group_size: int) -> int | None:
    """The group size a Linear of ``in_features`` inputs is quantized with: ``group_size``
    when it divides the width (or is -1, per output channel); else the largest multiple of
    :data:`GROUP_MULTIPLE` below it that does (SmolLM2's 576-wide inputs at 128: 96), which
    the checkpoint records per module as a GPTQModel ``dynamic`` override; None when no such
    divisor exists."""
    if group_size == -1 or in_features % group_size == 0:
        return group_size
    for gs in range(group_size - group_size % GROUP_MULTIPLE, 0, -GROUP_MULTIPLE):
        if in_features % gs == 0:
            return gs
    return None


@dataclass(frozen=True)
class LinearOutcome:
    """One quantized Linear: ``result``; ``weight [N, K]`` float32, what it approximates (after
    AWQ scaling, before clipping); ``gram [K, K]``, ``X^T X`` (any positive multiple) of its
    calibration inputs in the same (scaled) coordinates."""

    result: GPTQResult
    weight: torch.Tensor
    gram: torch.Tensor


Outcome = tuple[dict[str, LinearOutcome], torch.Tensor]
"""({Linear name relative to the layer: outcome}, next layer's input)."""


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``X^T X`` float32 ``[K, K]`` of inputs ``x [..., K]``."""
    xf = x.reshape(-1, x.shape[-1]).float()
    return xf.t() @ xf


def _install(lin: nn.Linear, res: GPTQResult) -> None:
    lin.weight.data.copy_(res.dequant.to(lin.weight.dtype))


@torch.no_grad()
def rtn_layer(layer: nn.Module, hidden: torch.Tensor, kw: dict[str, Any], names: list[str],
              o: LayerOptions) -> Outcome:
    """Round to nearest (§7.2); errors measured on the layer's fp inputs."""
    feats, nxt = record_inputs(layer, names, hidden, kw)
    out = {}
    for n in names:
        lin = layer.get_submodule(n)
        ow = o.for_width(lin.in_features)
        res = rtn_quantize(lin.weight.data, ow.bits, ow.group_size, ow.sym)
        out[n] = LinearOutcome(res, lin.weight.data.clone(), _gram(feats[n]))
        _install(lin, res)
    return out, nxt


@torch.no_grad()
def gptq_layer(layer: nn.Module, hidden: torch.Tensor, kw: dict[str, Any], names: list[str],
               o: LayerOptions) -> Outcome:
    """GPTQ, sub-group by sub-group: each sub-group's Hessian comes from a forward in which
    the earlier sub-groups are already quantized (§7.3)."""
    out = {}
    for group in gptq_subgroups(names):
        group = [g for g in group if g in names]
        if not group:
            continue
        accs = {g: HessianAccumulator(layer.get_submodule(g).in_features) for g in group}
        record_inputs(layer, group, hidden, kw, sink=lambda n, x: accs[n].add_batch(x))
        for g in group:
            lin = layer.get_submodule(g)
            ow = o.for_width(lin.in_features)
            if accs[g].n == 0:
                # NOTE: an expert no calibration token was routed to: GPTQ would zero its
                # every (dead) input column, so it is rounded to nearest instead
                logger.warning("%s saw no calibration tokens: rounded to nearest instead of "
                               "GPTQ (give more calibration text to calibrate it)", g)
                res = rtn_quantize(lin.weight.data, ow.bits, ow.group_size, ow.sym)
                out[g] = LinearOutcome(res, lin.weight.data.clone(), accs[g].h)
                _install(lin, res)
                continue
            res = gptq_quantize(lin.weight.data, accs[g].h, ow.bits, ow.group_size, ow.sym,
                                ow.desc_act, ow.static_groups, ow.damp_percent)
            out[g] = LinearOutcome(res, lin.weight.data.clone(), accs[g].h)
            _install(lin, res)
    return out, run_layer(layer, hidden, kw)


def _scaling_groups(layer: nn.Module, kw: dict[str, Any]
                    ) -> list[tuple[str, list[str], str, Callable[[torch.Tensor], torch.Tensor]]]:
    """AutoAWQ's Llama scaling groups (§7.4 step 2): (previous op, Linears scaled together,
    Linear whose input is searched on, module whose output is compared)."""
    sub = layer.get_submodule
    groups = [("input_layernorm", LINEARS[:3], "self_attn.q_proj", attention_forward(layer, kw)),
              ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp.gate_proj",
               layer.mlp),
              ("mlp.up_proj", ["mlp.down_proj"], "mlp.down_proj", sub("mlp.down_proj"))]
    if sub("self_attn.v_proj").weight.shape == sub("self_attn.o_proj").weight.shape:
        groups.insert(1, ("self_attn.v_proj", ["self_attn.o_proj"], "self_attn.o_proj",
                          sub("self_attn.o_proj")))
    return groups


def _awq_scale(layer: nn.Module, feats: dict[str, torch.Tensor], kw: dict[str, Any],
               names: list[str], o: LayerOptions) -> None:
    """Search every group's scales on the unmodified layer, then fold them all in and divide
    the recorded inputs (§7.4 "Scale search", "Applying the scales")."""
    sub = layer.get_submodule
    found = []
    for prev, lins, inp, fwd in _scaling_groups(layer, kw):
        if all(n in names for n in lins) and (prev not in LINEARS or prev in names):
            ow = o.for_width(sub(lins[0]).in_features)
            choice = awq_mod.search_best_scale(feats[inp], [sub(n) for n in lins], fwd,
                                               ow.bits, ow.group_size, ow.duo_scaling)
            found.append((prev, lins, choice.s))
    for prev, lins, s in found:
        awq_mod.apply_scale(sub(prev), [sub(n) for n in lins], s)
        for n in lins:
            feats[n] = feats[n] / s.to(feats[n].dtype)


@torch.no_grad()
def awq_layer(layer: nn.Module, hidden: torch.Tensor, kw: dict[str, Any], names: list[str],
              o: LayerOptions) -> Outcome:
    """AWQ (§7.4): scales, clipping (not for q/k), then AWQ's min-max grid."""
    feats, nxt = record_inputs(layer, names, hidden, kw)
    _awq_scale(layer, feats, kw, names, o)
    out = {}
    grams: dict[int, torch.Tensor] = {}
    for n in names:
        lin = layer.get_submodule(n)
        w = lin.weight.data.clone()
        ow = o.for_width(lin.in_features)
        if o.clip and not any(t in n for t in ("q_", "k_", "query", "key", "Wqkv")):
            mv = awq_mod.search_best_clip(lin.weight.data, feats[n], ow.bits, ow.group_size)
            awq_mod.apply_clip(lin, mv, ow.group_size)
        res = rtn_quantize(lin.weight.data, ow.bits, ow.group_size, sym=False, kind="awq")
        out[n] = LinearOutcome(res, w, grams.setdefault(id(feats[n]), _gram(feats[n])))
        _install(lin, res)
    return out, nxt


LAYER_METHODS: dict[str, Callable[..., Outcome]] = {
    "rtn": rtn_layer, "gptq": gptq_layer, "awq": awq_layer, "gptq-e2e": gptq_layer}
