"""``nybble quantize``: RTN / GPTQ / AWQ of a Llama folder into a servable quantized folder.

Driver of docs/quant-formats.md §7.3 (GPTQ, true-sequential sub-groups, quantized activations
fed forward) and §7.4 (AWQ, original activations fed forward). Linears whose input width is not
a multiple of the group size or of the packing factor (or whose output width is not a
multiple of the packing factor) stay dense and are listed in ``modules_to_not_convert``.
Output layout: RTN/GPTQ -> GPTQ (v1 when symmetric, ``gptq_v2`` when asymmetric); AWQ 4-bit ->
AutoAWQ GEMM; AWQ 8-bit (no AWQ layout exists) -> ``gptq_v2`` asymmetric with AWQ's grid.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from nybble.quantize import awq as awq_mod
from nybble.quantize.calibration import (
    BUILTIN_CALIB,
    attention_forward,
    calibration_ids,
    capture_first_layer_inputs,
    record_inputs,
    run_layer,
)
from nybble.quantize.export import (
    awq_config,
    gptq_config,
    pack_awq,
    pack_gptq,
    write_model_folder,
)
from nybble.quantize.gptq import GPTQResult, HessianAccumulator, gptq_quantize
from nybble.quantize.rtn import rtn_quantize

logger = logging.getLogger(__name__)

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
GPTQ_SUBGROUPS = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                  ["self_attn.o_proj"], ["mlp.up_proj", "mlp.gate_proj"], ["mlp.down_proj"]]


@dataclass
class QuantizeOptions:
    """Settings of one quantization run (CLI flags of ``nybble quantize``).

    Attributes:
        method: ``rtn`` | ``gptq`` | ``awq``. bits: 4 | 8. group_size: -1 or > 0.
        sym: symmetric grid (RTN/GPTQ; AWQ is always asymmetric).
        desc_act / static_groups / damp_percent: GPTQ act-order, static groups, dampening.
        calib_text: calibration text (None: the built-in text). num_samples, seq_len: how
            many calibration sequences of how many tokens.
        duo_scaling / clip: AWQ scale formula and clipping search.
    """

    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    sym: bool = False
    desc_act: bool = False
    static_groups: bool = False
    damp_percent: float = 0.01
    calib_text: str | None = None
    num_samples: int = 64
    seq_len: int = 256
    duo_scaling: bool = True
    clip: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in ("rtn", "gptq", "awq"):
            raise ValueError(f"method must be rtn, gptq or awq, got {self.method!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 or > 0, got {self.group_size!r}")
        if self.method == "awq":
            self.sym = False


def skip_reason(lin: nn.Linear, bits: int, group_size: int) -> str | None:
    """Why ``lin`` cannot be packed (None: it can)."""
    k, n = lin.in_features, lin.out_features
    pf = 32 // bits
    gs = k if group_size == -1 else group_size
    if k % gs:
        return f"input width {k} is not a multiple of group_size {gs}"
    if k % pf or n % pf:
        return f"widths [{n}, {k}] are not multiples of the packing factor {pf}"
    return None


def _gptq_layer(layer: nn.Module, hidden: torch.Tensor, kw: dict[str, Any],
                names: list[str], o: QuantizeOptions) -> dict[str, GPTQResult]:
    out: dict[str, GPTQResult] = {}
    for group in GPTQ_SUBGROUPS:
        group = [g for g in group if g in names]
        if not group:
            continue
        accs = {g: HessianAccumulator(layer.get_submodule(g).in_features) for g in group}
        record_inputs(layer, group, hidden, kw, sink=lambda n, x: accs[n].add_batch(x))
        for g in group:
            lin = layer.get_submodule(g)
            res = gptq_quantize(lin.weight.data, accs[g].h, o.bits, o.group_size, o.sym,
                                o.desc_act, o.static_groups, o.damp_percent)
            lin.weight.data.copy_(res.dequant.to(lin.weight.dtype))
            out[g] = res
    return out


def _awq_layer(layer: nn.Module, feats: dict[str, torch.Tensor], kw: dict[str, Any],
               names: list[str], o: QuantizeOptions) -> dict[str, GPTQResult]:
    sub = layer.get_submodule
    groups: list[tuple[str, list[str], str, Any]] = [
        ("input_layernorm", LINEARS[:3], "self_attn.q_proj", attention_forward(layer, kw)),
        ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], "mlp.gate_proj",
         layer.mlp),
        ("mlp.up_proj", ["mlp.down_proj"], "mlp.down_proj", sub("mlp.down_proj"))]
    if sub("self_attn.v_proj").weight.shape == sub("self_attn.o_proj").weight.shape:
        groups.insert(1, ("self_attn.v_proj", ["self_attn.o_proj"], "self_attn.o_proj",
                          sub("self_attn.o_proj")))
    found = []
    for prev, lins, inp, fwd in groups:
        if all(n in names for n in lins) and (prev not in LINEARS or prev in names):
            s, _, _ = awq_mod.search_best_scale(feats[inp], [sub(n) for n in lins], fwd,
                                                o.bits, o.group_size, o.duo_scaling)
            found.append((prev, lins, s))
    for prev, lins, s in found:
        awq_mod.apply_scale(sub(prev), [sub(n) for n in lins], s)
        for n in lins:
            feats[n] = feats[n] / s.to(feats[n].dtype)
    out: dict[str, GPTQResult] = {}
    for n in names:
        lin = sub(n)
        if o.clip and not any(t in n for t in ("q_", "k_", "query", "key", "Wqkv")):
            mv = awq_mod.search_best_clip(lin.weight.data, feats[n], o.bits, o.group_size)
            awq_mod.apply_clip(lin, mv, o.group_size)
        out[n] = rtn_quantize(lin.weight.data, o.bits, o.group_size, sym=False, kind="awq")
    return out


@torch.no_grad()
def quantize_model(model_dir: str, out_dir: str, opts: QuantizeOptions,
                   progress: bool = True) -> dict[str, Any]:
    """Quantize the Llama folder ``model_dir`` and write a complete folder ``out_dir``.

    Returns:
        Summary: ``{"quantized": [...], "skipped": {name: reason}, "config": dict}``.

    Raises:
        ValueError: bad options, empty calibration text, or no linear layer can be
            quantized with these options (nothing is written then).
    """
    from transformers import AutoTokenizer

    from nybble.quantize.hf_model import load_model

    model = load_model(model_dir, torch.float32)
    layers = model.model.layers
    names_per_layer: list[list[str]] = []
    skipped: dict[str, str] = {}
    for i, layer in enumerate(layers):
        ok = []
        for n in LINEARS:
            why = skip_reason(layer.get_submodule(n), opts.bits, opts.group_size)
            if why is None:
                ok.append(n)
            else:
                skipped[f"model.layers.{i}.{n}"] = why
                logger.warning("leaving model.layers.%d.%s unquantized: %s", i, n, why)
        names_per_layer.append(ok)
    if not any(names_per_layer):
        name, why = next(iter(skipped.items()), ("the model", "it has no decoder layers"))
        raise ValueError(f"nothing to quantize: all {len(skipped)} linear layers would stay "
                         f"dense ({name}: {why}); choose a --group-size that divides the "
                         f"layers' input widths")
    results: dict[str, GPTQResult] = {}
    if opts.method == "rtn":
        for i, layer in enumerate(layers):
            for n in names_per_layer[i]:
                results[f"model.layers.{i}.{n}"] = rtn_quantize(
                    layer.get_submodule(n).weight.data, opts.bits, opts.group_size, opts.sym)
    else:
        tok = AutoTokenizer.from_pretrained(model_dir)
        if opts.calib_text is None:
            with open(BUILTIN_CALIB, encoding="utf-8") as f:
                text = f.read()
        else:
            text = opts.calib_text
        ids = calibration_ids(tok, text, opts.num_samples, opts.seq_len,
                              model.config.bos_token_id)
        hidden, kw = capture_first_layer_inputs(model, ids)
        it = tqdm(list(enumerate(layers)), desc=f"{opts.method} layers", disable=not progress)
        for i, layer in it:
            if opts.method == "gptq":
                res = _gptq_layer(layer, hidden, kw, names_per_layer[i], opts)
                hidden = run_layer(layer, hidden, kw)
            else:
                feats, hidden = record_inputs(layer, names_per_layer[i], hidden, kw)
                res = _awq_layer(layer, feats, kw, names_per_layer[i], opts)
            results.update({f"model.layers.{i}.{n}": r for n, r in res.items()})
    awq_layout = opts.method == "awq" and opts.bits == 4
    v2 = not opts.sym
    qtensors = {p: (pack_awq(r) if awq_layout else pack_gptq(r, opts.bits, v2))
                for p, r in results.items()}
    skipped_names = sorted(skipped)
    cfg = (awq_config(opts.group_size, skipped_names) if awq_layout else
           gptq_config(opts.bits, opts.group_size, opts.sym, opts.desc_act, opts.static_groups,
                       opts.damp_percent, v2, skipped_names, opts.method))
    write_model_folder(model, model_dir, out_dir, qtensors, cfg)
    return {"quantized": sorted(results), "skipped": skipped, "config": cfg,
            "results": results}
