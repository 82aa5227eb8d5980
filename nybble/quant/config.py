"""Detect and normalise a checkpoint's quantization config; build its quantized linear layers.

Source: docs/quant-formats.md §2 (where the config lives, key synonyms, dispatch on
``quant_method``), §3.6 / §4.5 / §6.2 (fields). Supported: GPTQ (``gptq`` v1 and ``gptq_v2``,
4/8 bits, any group size, act-order ``g_idx``, sym/asym, GPTQModel ``dynamic``), AutoAWQ GEMM
(4-bit, zero_point), compressed-tensors ``pack-quantized`` (4/8-bit weights) and
``int-quantized`` W8A8 (per-channel int8 weights, dynamic per-token int8 activations).
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from nybble.errors import UnsupportedModelError
from nybble.model_files import model_weight_files, read_json
from nybble.quant.compressed import CompressedPackedLinear, Int8W8A8Linear
from nybble.quant.linear import AWQLinear, CpuPathLog, GPTQLinear

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors")
SUPPORTED = ("gptq (checkpoint_format gptq|gptq_v2, bits 4|8), awq (version gemm, bits 4, "
             "zero_point true), compressed-tensors (pack-quantized W4A16/W8A16, int-quantized W8A8)")
_SYNONYMS = {"w_bit": "bits", "q_group_size": "group_size"}


def _normalise(raw: dict[str, Any]) -> dict[str, Any]:
    out = {_SYNONYMS.get(k, k): v for k, v in raw.items()}
    if "quant_method" not in out and "method" in out:
        out["quant_method"] = out["method"]
    if "quant_method" not in out and {"w_bit", "q_group_size"} & set(raw):
        out["quant_method"] = "awq"  # old AutoAWQ quant_config.json has no quant_method
    if isinstance(out.get("quant_method"), str):
        out["quant_method"] = out["quant_method"].lower()
    return out


def find_raw_quant_config(model_dir: str, hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The normalised quantization dict of a model folder, or None (§2).

    ``config.json``'s ``quantization_config`` wins over ``quantize_config.json`` /
    ``quant_config.json``; a differing file is logged as a warning.
    """
    in_cfg = hf_config.get("quantization_config")
    side = None
    for name in ("quantize_config.json", "quant_config.json"):
        side = read_json(os.path.join(model_dir, name))
        if side is not None:
            break
    if in_cfg is not None:
        norm = _normalise(in_cfg)
        if side is not None:
            s = _normalise(side)
            diff = [k for k in ("bits", "group_size", "sym", "desc_act") if k in s and k in norm
                    and s[k] != norm[k]]
            if diff:
                logger.warning("quantize_config.json differs from config.json in %s; using "
                               "config.json", diff)
        return norm
    return _normalise(side) if side is not None else None


def _checkpoint_keys(model_dir: str) -> dict[str, str] | None:
    """``tensor name -> safetensors dtype`` over the model's weight files (headers only)."""
    from safetensors import safe_open

    try:
        files = model_weight_files(model_dir)
    except UnsupportedModelError:
        return None   # NOTE: the loader reports it
    keys: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                keys[k] = f.get_slice(k).get_dtype()
    return keys


def _quantized_prefixes(keys: dict[str, str], method: str, fmt: str) -> frozenset[str]:
    """Modules stored quantized: a module is quantized iff its tensors say so (§2)."""
    if method in ("gptq", "awq"):
        suffix = ".qweight"
    elif fmt == "pack-quantized":
        suffix = ".weight_packed"
    else:
        return frozenset(k[:-len(".weight")] for k, dt in keys.items()
                         if k.endswith(".weight") and dt == "I8")
    return frozenset(k[:-len(suffix)] for k in keys if k.endswith(suffix))


@dataclass(frozen=True)
class LayerParams:
    """Quantization settings of one Linear (after GPTQModel ``dynamic`` overrides)."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool

    def group_size_for(self, in_features: int) -> int:
        """The real group size of a layer ``in_features`` wide: ``group_size``, or
        ``in_features`` for a per-channel config (``group_size == -1``, §1).

        NOTE: the one place ``-1`` is resolved; the linear modules and kernels below only
        ever see a positive group size.
        """
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class QuantConfig:
    """A validated quantization config; :meth:`linear_factory` is a ``LinearFactory``.

    Attributes:
        method: ``gptq`` | ``awq`` | ``compressed-tensors``.
        fmt: ``gptq`` | ``gptq_v2`` | ``gemm`` | ``pack-quantized`` | ``int-quantized``.
        params: default per-layer settings (bits, group_size, sym, desc_act).
        modules_to_not_convert: name fragments left dense (substring match, AWQ/our exports).
        ignore: compressed-tensors ``ignore`` entries (exact name, suffix or ``re:`` regex).
        dynamic: GPTQModel ``{regex: overrides}``; ``-:`` keys mean "not quantized".
        lm_head: the checkpoint quantizes ``lm_head`` (GPTQModel ``lm_head: true``).
        quantized_prefixes: modules whose tensors are stored quantized (None: unknown).
        raw: the normalised dict, for logs.
        path_log: logs each CPU matmul choice of this model's layers once.
    """

    method: str
    fmt: str
    params: LayerParams
    modules_to_not_convert: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    dynamic: dict[str, dict[str, Any]] = field(default_factory=dict)
    lm_head: bool = False
    quantized_prefixes: frozenset[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    path_log: CpuPathLog = field(default_factory=CpuPathLog, compare=False, repr=False)

    def describe(self) -> str:
        """One line for start-up logs."""
        p = self.params
        gs = "per-channel" if p.group_size == -1 else f"g{p.group_size}"
        extra = "" if self.method != "gptq" else f" desc_act={p.desc_act}"
        n = "" if self.quantized_prefixes is None else f", {len(self.quantized_prefixes)} modules"
        return (f"{self.method} ({self.fmt}) {p.bits}-bit {gs} "
                f"{'sym' if p.sym else 'asym'}{extra}{n}")

    def layer_params(self, prefix: str) -> LayerParams | None:
        """Settings of module ``prefix``, or None when it stays dense."""
        for frag in self.modules_to_not_convert:
            if frag in prefix:
                return None
        for entry in self.ignore:
            if (entry[3:] and re.match(entry[3:], prefix)) if entry.startswith("re:") else (
                    prefix == entry or prefix.endswith("." + entry)):
                return None
        params = self.params
        for key, over in self.dynamic.items():
            if key.startswith("-:") and re.match(key[2:], prefix):
                return None
            pat = key.removeprefix("+:")
            if not key.startswith("-:") and re.match(pat, prefix):
                params = replace(params, **{k: v for k, v in over.items()
                                            if k in ("bits", "group_size", "sym", "desc_act")})
        if self.quantized_prefixes is not None:
            return params if prefix in self.quantized_prefixes else None
        is_head = prefix.split(".")[-1] == "lm_head"
        return params if (".layers." in f".{prefix}" or (is_head and self.lm_head)) else None

    def linear_factory(self, prefixes: list[str], in_features: int, out_features: list[int],
                       bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        """Build the quantized module of one (possibly fused) projection, or return None when
        the checkpoint stores it unquantized: "stay dense" (``nybble.models`` then builds its
        dense layer; this package sits below the models and never builds one).

        Raises:
            UnsupportedModelError: shards differ in quantization, or a shape the format
                cannot hold (e.g. an input width that is not a multiple of the group size).
        """
        per = [self.layer_params(p) for p in prefixes]
        if all(p is None for p in per):
            return None
        if any(p != per[0] for p in per):
            raise UnsupportedModelError(
                f"fused projection {prefixes} must have the same quantization in every shard, "
                f"got {per}")
        p = per[0]
        assert p is not None
        n = sum(out_features)
        gs = p.group_size_for(in_features)
        if in_features % gs or in_features % (32 // p.bits):
            raise UnsupportedModelError(
                f"in_features of {prefixes[0]} must be a multiple of group_size {gs} and of "
                f"{32 // p.bits}, got {in_features}")
        if self.method == "gptq":
            return GPTQLinear(in_features, n, bias, dtype, device, p.bits, gs,
                              1 if self.fmt == "gptq" else 0, p.sym, self.path_log)
        if self.method == "awq":
            return AWQLinear(in_features, n, bias, dtype, device, gs, self.path_log)
        if self.fmt == "pack-quantized":
            return CompressedPackedLinear(in_features, n, bias, dtype, device, p.bits, gs, p.sym,
                                          self.path_log)
        return Int8W8A8Linear(in_features, n, bias, dtype, device, self.path_log)


def _unsupported(what: str, value: object) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization {what} is not supported, got {value!r}; "
                                 f"supported: {SUPPORTED}")


def _parse_gptq(c: dict[str, Any]) -> QuantConfig:
    fmt = str(c.get("checkpoint_format") or c.get("format") or "gptq").lower()
    if c.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise _unsupported("gptq checkpoint_format", "marlin" if c.get("is_marlin_format") else fmt)
    if str(c.get("pack_dtype", "int32")) != "int32":
        raise _unsupported("gptq pack_dtype", c.get("pack_dtype"))
    if "sym" not in c:
        logger.warning("GPTQ config has no 'sym'; assuming sym=true (as AutoGPTQ does)")
    params = LayerParams(int(c.get("bits", 4)), int(c.get("group_size", -1)),
                         bool(c.get("sym", True)), bool(c.get("desc_act", False)))
    dynamic = dict(c.get("dynamic") or {})
    for p in [params] + [replace(params, **{k: v for k, v in o.items() if k in
                                            ("bits", "group_size", "sym", "desc_act")})
                         for k, o in dynamic.items() if not k.startswith("-:")]:
        if p.bits not in (4, 8):
            raise _unsupported("gptq bits", p.bits)
        if p.group_size != -1 and p.group_size <= 0:
            raise _unsupported("gptq group_size", p.group_size)
    return QuantConfig("gptq", fmt, params, tuple(c.get("modules_to_not_convert") or ()),
                       dynamic=dynamic, lm_head=bool(c.get("lm_head", False)), raw=c)


def _parse_awq(c: dict[str, Any]) -> QuantConfig:
    fmt = str(c.get("version") or c.get("format") or "gemm").lower()
    if fmt != "gemm":
        raise _unsupported("awq version", fmt)
    bits, gs = int(c.get("bits", 4)), int(c.get("group_size", 128))
    if bits != 4:
        raise _unsupported("awq bits", bits)
    if not c.get("zero_point", True):
        raise _unsupported("awq zero_point", c.get("zero_point"))
    return QuantConfig("awq", "gemm", LayerParams(bits, gs, False, False),
                       tuple(c.get("modules_to_not_convert") or ()), raw=c)


def _parse_ct(c: dict[str, Any]) -> QuantConfig:
    fmt = str(c.get("format", "")).lower()
    groups = list((c.get("config_groups") or {}).values())
    if fmt not in ("pack-quantized", "int-quantized"):
        raise _unsupported("compressed-tensors format", fmt)
    if len(groups) != 1 or c.get("sparsity_config") or c.get("transform_config"):
        raise _unsupported("compressed-tensors config_groups/sparsity/transform",
                           f"{len(groups)} groups")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    bits, strat, sym = int(w.get("num_bits", 0)), w.get("strategy"), bool(w.get("symmetric"))
    if w.get("type") != "int" or w.get("dynamic"):
        raise _unsupported("compressed-tensors weights type", w.get("type"))
    if fmt == "pack-quantized":
        if bits not in (4, 8) or strat not in ("group", "channel") or a is not None:
            raise _unsupported("compressed-tensors pack-quantized scheme",
                               f"bits={bits} strategy={strat} input_activations={a}")
        gs = int(w["group_size"]) if strat == "group" else -1
    else:
        ok_a = (a is not None and a.get("num_bits") == 8 and a.get("dynamic") is True
                and a.get("strategy") == "token" and a.get("symmetric"))
        if bits != 8 or strat != "channel" or not sym or not ok_a:
            raise _unsupported("compressed-tensors int-quantized scheme",
                               f"weights bits={bits} strategy={strat} sym={sym}, "
                               f"input_activations={a}")
        gs = -1
    return QuantConfig("compressed-tensors", fmt, LayerParams(bits, gs, sym, False),
                       ignore=tuple(c.get("ignore") or ()), raw=c)


def load_quant_config(model_dir: str, hf_config: dict[str, Any],
                      override: str | None = None) -> QuantConfig | None:
    """Detect, validate and normalise the quantization of a model folder.

    Args:
        model_dir: the model folder (``quantize_config.json`` and weights are read from it).
        hf_config: the parsed ``config.json``.
        override: ``--quantization`` value (``gptq``/``awq``/``compressed-tensors``) or None.

    Returns:
        None for an unquantized model, else a :class:`QuantConfig`.

    Raises:
        UnsupportedModelError: unknown/unsupported method, bits or layout; or ``override``
            differs from the checkpoint (or the checkpoint is not quantized).
    """
    if override is not None and override not in METHODS:
        raise UnsupportedModelError(f"quantization must be one of {METHODS}, got {override!r}")
    raw = find_raw_quant_config(model_dir, hf_config)
    if raw is None:
        if override is not None:
            raise UnsupportedModelError(f"quantization {override!r} was requested but "
                                        f"{model_dir} has no quantization_config")
        return None
    method = raw.get("quant_method")
    if override is not None and override != method:
        raise UnsupportedModelError(f"quantization {override!r} was requested but the checkpoint "
                                    f"is quantized with {method!r}")
    parsers = {"gptq": _parse_gptq, "awq": _parse_awq, "compressed-tensors": _parse_ct}
    if method not in parsers:
        raise _unsupported("method", method)
    qc = parsers[method](raw)
    keys = _checkpoint_keys(model_dir) if os.path.isdir(model_dir) else None
    if keys is not None:
        qc = replace(qc, quantized_prefixes=_quantized_prefixes(keys, qc.method, qc.fmt))
    return qc
