"""Write quantized Linears in the published layouts and a complete model folder.

GPTQ: ``qweight = pack_rows(q^T)``, ``qzeros = pack_cols(zero field)`` (v1 stores ``z - 1``
field-wise, v2 stores ``z``), ``scales [G, N]`` fp16, ``g_idx [K]`` (docs/quant-formats.md §3).
AWQ GEMM: ``qweight = pack_cols(q^T, AWQ_ORDER)``, ``qzeros`` likewise, ``scales`` fp16 (§4).
Config dicts follow what AutoGPTQ 0.7.1 / GPTQModel (v2) / AutoAWQ 0.2.9 write (§3.6, §4.5).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nybble import __version__
from nybble.kernels.packing import AWQ_ORDER, pack_cols, pack_rows
from nybble.quantize.gptq import GPTQResult

_SKIP_COPY = ("config.json", "quantize_config.json", "quant_config.json",
              "model.safetensors.index.json", "README.md")


def pack_gptq(res: GPTQResult, bits: int, v2: bool) -> dict[str, torch.Tensor]:
    """GPTQ tensors of one Linear from ``res`` (``q [N, K]``, ``zero [N, G]``)."""
    mask = (1 << bits) - 1
    z = res.zero.t().round().to(torch.int64)  # [G, N]
    field = z if v2 else (z - 1) & mask
    return {"qweight": pack_rows(res.q.t().contiguous(), bits),
            "qzeros": pack_cols(field, bits),
            "scales": res.scale.t().contiguous().to(torch.float16),
            "g_idx": res.g_idx.to(torch.int32)}


def pack_awq(res: GPTQResult) -> dict[str, torch.Tensor]:
    """AWQ GEMM 4-bit tensors of one Linear (``qweight [K, N/8]``, ``qzeros [G, N/8]``)."""
    return {"qweight": pack_cols(res.q.t().contiguous(), 4, AWQ_ORDER),
            "qzeros": pack_cols(res.zero.t().round().to(torch.int64), 4, AWQ_ORDER),
            "scales": res.scale.t().contiguous().to(torch.float16)}


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, static_groups: bool,
                damp: float, v2: bool, skipped: list[str], method: str) -> dict[str, Any]:
    """``quantization_config`` as AutoGPTQ writes it (v1), with GPTQModel's ``format`` /
    ``checkpoint_format`` keys for v2, plus ``modules_to_not_convert`` and a provenance
    ``meta``."""
    cfg: dict[str, Any] = {
        "bits": bits, "group_size": group_size, "damp_percent": damp, "desc_act": desc_act,
        "static_groups": static_groups, "sym": sym, "true_sequential": True,
        "model_name_or_path": None, "model_file_base_name": None, "is_marlin_format": False,
        "quant_method": "gptq", "checkpoint_format": "gptq_v2" if v2 else "gptq",
        "modules_to_not_convert": skipped or None,
        "meta": {"quantizer": [f"nybble:{__version__}"], "method": method}}
    if v2:
        cfg["format"] = "gptq_v2"
        cfg["pack_dtype"] = "int32"
    return cfg


def awq_config(group_size: int, skipped: list[str]) -> dict[str, Any]:
    """``quantization_config`` as AutoAWQ 0.2.9 writes it."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": skipped or None}


def write_model_folder(model: nn.Module, src_dir: str, out_dir: str,
                       qtensors: dict[str, dict[str, torch.Tensor]],
                       qconfig: dict[str, Any],
                       rename: Callable[[str], str] | None = None) -> None:
    """Write ``out_dir``: ``model.safetensors`` (quantized Linears as ``qtensors[prefix]``, every
    other tensor of ``model`` as is, tied ``lm_head`` omitted; a quantized ``lm_head`` of a
    tied model unties the written config), ``config.json`` with
    ``quantization_config`` (and ``quantize_config.json`` for GPTQ), tokenizer and generation
    files copied from ``src_dir``. ``rename`` maps the model's tensor names to the
    checkpoint's (``qtensors`` is keyed by checkpoint names already; default: the same)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(src_dir, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    if tied and "lm_head" in qtensors:   # a quantized head of its own, the float embedding kept
        hf_config["tie_word_embeddings"] = False
    tensors: dict[str, torch.Tensor] = {}
    quantized = {p + ".weight" for p in qtensors}
    for name, t in model.state_dict().items():
        name = rename(name) if rename is not None else name
        if name in quantized or "rotary_emb" in name or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = t.detach().contiguous().clone()
    for prefix, d in qtensors.items():
        for k, t in d.items():
            tensors[f"{prefix}.{k}"] = t.contiguous()
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # NOTE: safetensors writes 0600; other files get 0644
    hf_config["quantization_config"] = qconfig
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    if qconfig["quant_method"] == "gptq":
        with open(os.path.join(out_dir, "quantize_config.json"), "w", encoding="utf-8") as f:
            json.dump(qconfig, f, indent=2)
    for fname in os.listdir(src_dir):
        path = os.path.join(src_dir, fname)
        if (os.path.isfile(path) and fname not in _SKIP_COPY
                and not fname.endswith(".safetensors")):
            shutil.copyfile(path, os.path.join(out_dir, fname))  # contents only, not modes
