"""``nybble quantize``: RTN / GPTQ / AWQ / GPTQ-E2E of a Llama folder into a servable folder
(a mixture-of-experts one, Qwen3-MoE or Mixtral: RTN / GPTQ, every expert projection a Linear
of its own, :mod:`nybble.quantize.moe_experts`).

Driver of docs/quant-formats.md §7.3 / §7.4: capture the first decoder layer's inputs on the
calibration text, then quantize layer by layer (:mod:`nybble.quantize.layer_quant`). Linears
whose input width is not a multiple of the group size or of the packing factor (or whose
output width is not a multiple of the packing factor) stay dense and are listed in
``modules_to_not_convert``. Output layout: RTN/GPTQ/GPTQ-E2E -> GPTQ (v1 when symmetric,
``gptq_v2`` when asymmetric); AWQ 4-bit -> AutoAWQ GEMM; AWQ 8-bit (no AWQ layout exists) ->
``gptq_v2`` asymmetric with AWQ's grid. Beside the weights: ``quantization_report.json`` and a
``README.md`` table (:mod:`nybble.quantize.report`). With ``format="gguf"`` one GGUF file is
written instead (:mod:`nybble.quantize.gguf_export`), its report beside it.

NOTE: deterministic. The same inputs and ``threads`` give byte-identical weight files: torch's
CPU reductions and GEMMs split their sums by thread count, so the count is pinned for the run
(default 1) rather than taken from the machine; nothing else depends on time, randomness or
set order.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from nybble import __version__
from nybble.quantize.calibration import (
    calibration_ids,
    capture_first_layer_inputs,
)
from nybble.quantize.export import (
    awq_config,
    gptq_config,
    pack_awq,
    pack_gptq,
    write_model_folder,
)
from nybble.quantize.e2e import TuneOptions, tune_scales
from nybble.quantize.gguf_export import check_gguf_config, check_gguf_options, write_gguf
from nybble.quantize.gptq import GPTQResult
from nybble.quantize.layer_quant import (LAYER_METHODS, LayerOptions, LinearOutcome,
                                         group_size_for, layer_linears)
from nybble.quantize.moe_experts import checkpoint_name
from nybble.quantize.rtn import rtn_quantize
from nybble.quantize.sampled_calibration import (REPORT_TOKENS, SEED, calibration_need,
                                                  sample_calibration_ids)
from nybble.quantize.report import (
    build_report,
    checkpoint_tensor_bytes,
    relative_output_error,
    safetensors_bytes,
    text_sha256,
    write_report,
)

logger = logging.getLogger(__name__)

METHODS = tuple(LAYER_METHODS)
FORMATS = ("hf", "gguf")


@dataclass
class QuantizeOptions:
    """Settings of one quantization run (CLI flags of ``nybble quantize``).

    Attributes:
        method: ``rtn`` | ``gptq`` | ``awq`` | ``gptq-e2e``. bits: 4 | 8.
        group_size: -1 (per output channel) or > 0 input channels per scale.
        sym: symmetric grid (RTN/GPTQ/GPTQ-E2E; AWQ is always asymmetric).
        desc_act / static_groups / damp_percent: GPTQ act order (None: on for ``gptq-e2e``,
            off otherwise), static groups, dampening (fraction of the mean Hessian diagonal).
        calib_text: calibration text (None: text sampled from the model itself,
            :mod:`nybble.quantize.sampled_calibration`); calib_source names it in the report.
            num_samples, seq_len: at most this many sequences of this many tokens.
        duo_scaling / clip: AWQ scale formula (True: AutoAWQ's, False: the paper's, "both":
            search both) and clipping search.
        tune: GPTQ-E2E scale tuning (steps, batch, learning rate).
        threads: torch intra-op threads during the run (results depend on it, see module).
        eval_text: held-out text whose perplexity (before and after) goes into the report;
            eval_source names it.
        lm_head: also quantize the output head, RTN symmetric INT8 with ``group_size`` (32
            for a per-channel run), written as GPTQModel's ``lm_head: true`` (a tied
            embedding stays float for the lookup and the config is untied).
        allow_unquantized: write the checkpoint even when some decoder Linears cannot be
            quantized with these settings (they stay dense); without it that is an error.
        format: ``hf`` (a model folder, GPTQ or AWQ layout) or ``gguf`` (one GGUF file,
            :mod:`nybble.quantize.gguf_export`: group size 32, no act order unless with static
            groups, not 8-bit asymmetric; checked here, before any work; act order defaults
            to off; no per-module group-size fallback, such Linears stay dense).

    A Linear whose input width ``group_size`` does not divide is quantized with the largest
    multiple of 8 below it that does (:func:`~nybble.quantize.layer_quant.group_size_for`),
    recorded per module as a GPTQModel ``dynamic`` override; AutoAWQ's 4-bit format has one
    group size for every module, so there such a Linear cannot be quantized.
    """

    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    sym: bool = False
    desc_act: bool | None = None
    static_groups: bool = False
    damp_percent: float = 0.01
    calib_text: str | None = None
    calib_source: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    duo_scaling: bool | str = "both"
    clip: bool = True
    tune: TuneOptions = field(default_factory=TuneOptions)
    threads: int = 1
    eval_text: str | None = None
    eval_source: str | None = None
    lm_head: bool = False
    allow_unquantized: bool = False
    format: str = "hf"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 or > 0, got {self.group_size!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if self.method == "awq":
            self.sym = False
            if self.lm_head:
                raise ValueError("lm_head quantization writes a GPTQ-format head: use method "
                                 "rtn, gptq or gptq-e2e (AutoAWQ's format has no lm_head)")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.desc_act is None:
            self.desc_act = self.method == "gptq-e2e" and self.format != "gguf"
        if self.format == "gguf":
            check_gguf_options(self.bits, self.group_size, self.sym, self.desc_act,
                               self.static_groups)

    @property
    def awq_layout(self) -> bool:
        """Written in AutoAWQ's GEMM format (4-bit AWQ); else GPTQ's."""
        return self.method == "awq" and self.bits == 4

    def layer_options(self) -> LayerOptions:
        """The per-layer subset."""
        return LayerOptions(self.bits, self.group_size, self.sym, bool(self.desc_act),
                            self.static_groups, self.damp_percent, self.duo_scaling, self.clip)


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


def _packable(layers: nn.ModuleList, opts: QuantizeOptions
              ) -> tuple[list[list[str]], dict[str, str], dict[str, int]]:
    """Which Linears of each layer get quantized: ``(names per layer, {skipped: why},
    {regrouped: group size})``.

    Raises:
        ValueError: nothing can be quantized, some Linears cannot and
            ``opts.allow_unquantized`` is off, or a layer lacks one of the projections
            (a fused-checkpoint family: Phi-3).
    """
    names_per_layer: list[list[str]] = []
    skipped: dict[str, str] = {}
    regrouped: dict[str, int] = {}
    for i, layer in enumerate(layers):
        ok = []
        for n in layer_linears(layer):
            try:
                lin = layer.get_submodule(n)
            except AttributeError:
                raise ValueError(
                    f"nybble quantize needs every layer's q/k/v/o and gate/up/down projections "
                    f"as separate Linears; layer {i} has no {n} (fused-checkpoint families "
                    f"such as Phi-3, whose files store qkv_proj and gate_up_proj, are not "
                    f"quantized by nybble yet; serve the float model)") from None
            gs = opts.group_size if opts.awq_layout or opts.format == "gguf" else (
                group_size_for(lin.in_features, opts.group_size) or opts.group_size)
            why = skip_reason(lin, opts.bits, gs)
            if why is None:
                ok.append(n)
                if gs != opts.group_size:
                    regrouped[f"model.layers.{i}.{n}"] = gs
            else:
                skipped[f"model.layers.{i}.{n}"] = why
        names_per_layer.append(ok)
    if not any(names_per_layer):
        name, why = next(iter(skipped.items()), ("the model", "it has no decoder layers"))
        raise ValueError(f"nothing to quantize: all {len(skipped)} linear layers would stay "
                         f"dense ({name}: {why}); choose a --group-size that divides the "
                         f"layers' input widths")
    if skipped and not opts.allow_unquantized:
        name, why = next(iter(skipped.items()))
        other = " or a method written as GPTQ (rtn, gptq)" if opts.awq_layout else ""
        hint = ("GGUF blocks hold 32 weights, so" if opts.format == "gguf" else
                f"choose another --group-size{other}, or")
        raise ValueError(
            f"{len(skipped)} of {len(skipped) + sum(map(len, names_per_layer))} linear layers "
            f"cannot be quantized with these settings ({name}: {why}); {hint} pass "
            f"--allow-unquantized to leave them dense")
    for name, why in skipped.items():
        logger.warning("leaving %s unquantized: %s", name, why)
    return names_per_layer, skipped, regrouped


def group_overrides(regrouped: dict[str, int]) -> dict[str, dict[str, int]]:
    """GPTQModel ``dynamic`` entries for Linears quantized with another group size: one
    regex per module name and group size (``+:model\\.layers\\.\\d+\\.mlp\\.up_proj$``) when
    every layer's module of that name got it, else one per layer."""
    by_module: dict[str, dict[int, list[str]]] = {}
    for prefix, gs in regrouped.items():
        _, _, idx, module = prefix.split(".", 3)
        by_module.setdefault(module, {}).setdefault(gs, []).append(idx)
    layers = {prefix.split(".")[2] for prefix in regrouped}
    out: dict[str, dict[str, int]] = {}
    for module, sizes in sorted(by_module.items()):
        esc = re.escape(module)
        for gs, idxs in sorted(sizes.items()):
            if len(sizes) == 1 and len(idxs) == len(layers):
                out[f"+:model\\.layers\\.\\d+\\.{esc}$"] = {"group_size": gs}
            else:
                for i in sorted(idxs, key=int):
                    out[f"+:model\\.layers\\.{i}\\.{esc}$"] = {"group_size": gs}
    return out


def _calibration(model: nn.Module, model_dir: str, opts: QuantizeOptions,
                 names_per_layer: list[list[str]]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The calibration windows ``[S, L]`` and their report entry: the user's text, or text
    sampled from the model (:mod:`nybble.quantize.sampled_calibration`); a warning when they
    hold fewer tokens than the method needs."""
    from transformers import AutoTokenizer

    widest = max((layer.get_submodule(n).in_features
                  for layer, names in zip(model.model.layers, names_per_layer) for n in names),
                 default=0)
    need = calibration_need(opts.method, widest)
    seq_len = min(opts.seq_len, getattr(model.config, "max_position_embeddings", opts.seq_len))
    if opts.calib_text is None:
        ids = sample_calibration_ids(model, max(need, REPORT_TOKENS), seq_len, opts.num_samples)
        source, digest = (f"sampled from the model (seed {SEED}, temperature 1, from BOS)",
                          hashlib.sha256(ids.numpy().tobytes()).hexdigest())
    else:
        text, source = opts.calib_text, opts.calib_source or "calib_text"
        ids = calibration_ids(AutoTokenizer.from_pretrained(model_dir), text, opts.num_samples,
                              seq_len, model.config.bos_token_id)
        digest = text_sha256(text)
    calibration = {"source": source, "sha256": digest, "sequences": ids.shape[0],
                   "seq_len": ids.shape[1], "tokens": ids.numel(), "tokens_needed": need}
    if ids.numel() < need:
        logger.warning("calibration has %d tokens, fewer than the %d that %s needs here (4 per "
                       "input channel of the widest Linear, %d, and at least 2048): give more "
                       "text with --calib or raise --num-samples / --seq-len", ids.numel(),
                       need, opts.method, widest)
    return ids, calibration


@torch.no_grad()
def _run(model: nn.Module, model_dir: str, opts: QuantizeOptions, progress: bool
         ) -> tuple[dict[str, GPTQResult], dict[str, float], dict[str, str], dict[str, Any],
                    dict[str, Any] | None, dict[str, int]]:
    from nybble.quantize.hf_model import load_model, read_hf_config

    layers = model.model.layers
    names_per_layer, skipped, regrouped = _packable(layers, opts)
    ids, calibration = _calibration(model, model_dir, opts, names_per_layer)
    hidden, kw = capture_first_layer_inputs(model, ids)
    fn, lo = LAYER_METHODS[opts.method], opts.layer_options()
    outcomes: dict[str, LinearOutcome] = {}
    it = tqdm(list(enumerate(layers)), desc=f"{opts.method} layers", disable=not progress)
    for i, layer in it:
        out, hidden = fn(layer, hidden, kw, names_per_layer[i], lo)
        for n in names_per_layer[i]:  # NOTE: LINEARS order, not dict order
            outcomes[f"model.layers.{i}.{n}"] = out[n]
    del hidden
    results = {k: o.result for k, o in outcomes.items()}
    tuning = None
    if opts.method == "gptq-e2e":
        results, losses = tune_scales(load_model(model_dir, torch.float32), model, results, ids,
                                      opts.tune)
        tuning = {"steps": opts.tune.steps, "batch": opts.tune.batch, "lr": opts.tune.lr,
                  "kl_first": losses[0] if losses else None,
                  "kl_last": losses[-1] if losses else None}
    # NOTE: against the weight as written and dequantized by every loader (fp16 scales times
    # integers, rounded to fp16), not the quantizer's float32 product
    errors = {k: relative_output_error(o.weight, results[k].dequant.half().float(), o.gram)
              for k, o in outcomes.items()}
    # the checkpoint's names from here on (Mixtral's experts live in block_sparse_moe)
    name = checkpoint_name(read_hf_config(model_dir))
    return ({name(k): v for k, v in results.items()}, {name(k): v for k, v in errors.items()},
            {name(k): v for k, v in skipped.items()}, calibration, tuning,
            {name(k): v for k, v in regrouped.items()})


def check_moe_options(model: nn.Module, opts: QuantizeOptions) -> None:
    """Before quantizing: a mixture-of-experts model (its experts split into Linears,
    :mod:`nybble.quantize.moe_experts`) takes ``rtn`` or ``gptq`` into a model folder only.

    Raises:
        ValueError: ``awq`` or ``gptq-e2e``, or ``format="gguf"``, for such a model.
    """
    if not any(".experts." in n for layer in model.model.layers for n in layer_linears(layer)):
        return
    if opts.method not in ("rtn", "gptq"):
        raise ValueError(f"a mixture-of-experts model can be quantized with method rtn or "
                         f"gptq, got {opts.method!r}")
    if opts.format != "hf":
        raise ValueError(f"a mixture-of-experts model is written as a model folder (format "
                         f"hf), got format {opts.format!r}")


HEAD = "lm_head"
HEAD_BITS = 8


def head_group_size(hidden: int, opts: QuantizeOptions) -> int:
    """The group size of a quantized output head: the run's (32 for a per-channel run), or
    one group per row when that does not divide ``hidden``."""
    gs = opts.group_size if opts.group_size != -1 else 32
    return hidden if hidden % gs else gs


def lm_head_result(model: nn.Module, opts: QuantizeOptions) -> GPTQResult:
    """The output head quantized RTN, symmetric, :data:`HEAD_BITS` bits,
    :func:`head_group_size`."""
    w = model.get_output_embeddings().weight.detach().float()
    return rtn_quantize(w, HEAD_BITS, head_group_size(w.shape[1], opts), sym=True)


def quantized_lm_head(model: nn.Module, opts: QuantizeOptions, v2: bool
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The output head as GPTQ tensors (:func:`lm_head_result`) and the ``dynamic`` override
    that tells a loader its settings where they differ from the layers' (empty when they do
    not)."""
    res = lm_head_result(model, opts)
    gs = int(res.q.shape[1] // res.scale.shape[1])
    over = {k: v for k, v in (("bits", HEAD_BITS), ("group_size", gs), ("sym", True),
                              ("desc_act", False))
            if v != {"bits": opts.bits, "group_size": opts.group_size, "sym": opts.sym,
                     "desc_act": bool(opts.desc_act)}[k]}
    return pack_gptq(res, HEAD_BITS, v2), over


def _perplexity(model: str, text: str, tokenizer_dir: str | None = None) -> dict[str, float]:
    from transformers import AutoTokenizer

    from nybble.quantize.eval_ppl import nybble_logits_fn, perplexity

    return perplexity(nybble_logits_fn(model),
                      AutoTokenizer.from_pretrained(tokenizer_dir or model), text)


def _write_folder(model: nn.Module, model_dir: str, out_dir: str, opts: QuantizeOptions,
                  results: dict[str, GPTQResult], skipped: list[str],
                  regrouped: dict[str, int]) -> tuple[dict[str, Any], int]:
    """Write the GPTQ / AWQ model folder: ``(quantization_config, packed linear bytes)``."""
    from nybble.quantize.hf_model import read_hf_config

    awq_layout = opts.awq_layout
    v2 = not opts.sym
    qtensors = {p: (pack_awq(r) if awq_layout else pack_gptq(r, opts.bits, v2))
                for p, r in results.items()}
    cfg = (awq_config(opts.group_size, skipped) if awq_layout else
           gptq_config(opts.bits, opts.group_size, opts.sym, bool(opts.desc_act),
                       opts.static_groups, opts.damp_percent, v2, skipped, opts.method))
    dynamic = group_overrides(regrouped)
    if opts.lm_head:
        qtensors[HEAD], head_override = quantized_lm_head(model, opts, v2)
        cfg["lm_head"] = True
        if head_override:
            dynamic[f"+:{HEAD}$"] = head_override
    if dynamic:
        cfg["dynamic"] = dynamic
    write_model_folder(model, model_dir, out_dir, qtensors, cfg,
                       checkpoint_name(read_hf_config(model_dir)))
    return cfg, sum(t.numel() * t.element_size() for d in qtensors.values() for t in d.values())


def _write_gguf_file(model: nn.Module, model_dir: str, out: str, opts: QuantizeOptions,
                     results: dict[str, GPTQResult], skipped: list[str]
                     ) -> tuple[dict[str, Any], int]:
    """Write the GGUF file ``out``: ``(a config-like summary, quantized tensor bytes)``."""
    from nybble.quantize.hf_model import read_hf_config

    head = lm_head_result(model, opts) if opts.lm_head else None
    written = write_gguf(out, model.state_dict(), read_hf_config(model_dir), model_dir, results,
                         opts.bits, opts.sym, head)
    types: dict[str, int] = {}
    for t in written["types"].values():
        types[t] = types.get(t, 0) + 1
    cfg = {"quant_method": "gguf", "type": written["file_type"], "bits": opts.bits,
           "group_size": opts.group_size, "sym": opts.sym, "desc_act": bool(opts.desc_act),
           "static_groups": opts.static_groups, "lm_head": opts.lm_head,
           "modules_to_not_convert": skipped or None, "tensor_types": types,
           "meta": {"quantizer": [f"nybble:{__version__}"], "method": opts.method}}
    return cfg, int(written["quantized_bytes"])


def _check_gguf_model(model: nn.Module, model_dir: str, opts: QuantizeOptions) -> None:
    """Before quantizing, for a GGUF run: the config maps (architecture, activation, RoPE),
    and a quantized head fits Q8_0 blocks (32 | hidden)."""
    from nybble.quantize.hf_model import read_hf_config

    if opts.format != "gguf":
        return
    check_gguf_config(read_hf_config(model_dir))
    hidden = model.get_output_embeddings().weight.shape[1]
    if opts.lm_head and head_group_size(hidden, opts) != 32:
        raise ValueError(f"--quantize-lm-head with --format gguf writes the head as Q8_0, "
                         f"blocks of 32 along the hidden size, which {hidden} is not a "
                         f"multiple of; drop --quantize-lm-head")


def quantize_model(model_dir: str, out_dir: str, opts: QuantizeOptions,
                   progress: bool = True) -> dict[str, Any]:
    """Quantize the Llama folder ``model_dir`` and write a complete folder ``out_dir`` with
    its quality report; with ``opts.format == "gguf"``, ``out_dir`` is the ``.gguf`` file
    to write and the report goes beside it (:func:`nybble.quant.report.report_path`).

    Returns:
        ``{"quantized": [...], "skipped": {name: reason}, "regrouped": {name: group size},
        "config": dict, "results": {name: GPTQResult}, "report": dict}``.

    Raises:
        ValueError: bad options, empty calibration text, or some linear layer cannot be
            quantized with these options (all of them, or any without
            ``allow_unquantized``; nothing is written then).
    """
    from nybble.quantize.hf_model import load_model

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    gguf_out = opts.format == "gguf"
    try:
        model = load_model(model_dir, torch.float32)
        check_moe_options(model, opts)
        _check_gguf_model(model, model_dir, opts)
        results, errors, skipped, calibration, tuning, regrouped = _run(model, model_dir, opts,
                                                                        progress)
        if gguf_out:
            cfg, lin_after = _write_gguf_file(model, model_dir, out_dir, opts, results,
                                              sorted(skipped))
        else:
            cfg, lin_after = _write_folder(model, model_dir, out_dir, opts, results,
                                           sorted(skipped), regrouped)
        wall = time.perf_counter() - t0
        ppl = None
        if opts.eval_text is not None:
            before = _perplexity(model_dir, opts.eval_text)
            after = _perplexity(out_dir, opts.eval_text, model_dir if gguf_out else None)
            ppl = {"text": opts.eval_source or "eval_text", "sha256": text_sha256(opts.eval_text),
                   "tokens": int(after["tokens"]), "before": before["perplexity"],
                   "after": after["perplexity"]}
    finally:
        torch.set_num_threads(threads)
    head_src = ([] if not opts.lm_head else
                ["model.embed_tokens.weight"] if model.config.tie_word_embeddings else
                [HEAD + ".weight"])
    lin_before = checkpoint_tensor_bytes(model_dir, [p + ".weight" for p in results] + head_src)
    settings = {"method": opts.method, "bits": opts.bits, "group_size": opts.group_size,
                "sym": opts.sym, "desc_act": opts.desc_act, "static_groups": opts.static_groups,
                "threads": opts.threads, "quantization_config": cfg, "tuning": tuning}
    report = build_report(settings, calibration, errors, skipped,
                          {"linear_before": lin_before, "linear_after": lin_after,
                           "checkpoint_before": safetensors_bytes(model_dir),
                           "checkpoint_after": (os.path.getsize(out_dir) if gguf_out else
                                                safetensors_bytes(out_dir))}, wall, ppl)
    write_report(out_dir, report)
    return {"quantized": sorted(results), "skipped": skipped, "regrouped": regrouped,
            "config": cfg, "results": results, "report": report}
