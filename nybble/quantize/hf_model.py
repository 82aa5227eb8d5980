"""A transformers ``LlamaForCausalLM`` whose Linears are our quantized modules.

Used by calibration, ``eval-ppl`` and the quality benchmark, independently of the engine's own
model code: every ``nn.Linear`` for which the checkpoint's :class:`QuantConfig` builds a
quantized module is replaced by it (tensors loaded with the module's own ``load_tensors``);
all other tensors (embeddings, norms, dense linears) load through ``load_state_dict``. A
mixture-of-experts model's stacked experts are first split into one ``nn.Linear`` per expert
projection (:mod:`nybble.quantize.moe_experts`), named as in the checkpoint.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from nybble.model_files import model_weight_files
from nybble.quant.config import load_quant_config
from nybble.quantize.moe_experts import checkpoint_name, model_name, unfuse_experts


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return dict(json.load(f))


def load_checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's weight files (:func:`model_weight_files`).

    Raises:
        UnsupportedModelError: no weight files, or an index pointing outside the folder.
    """
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in model_weight_files(model_dir):
        out.update(load_file(path))
    return out


def build_fp_model(hf_config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """An uninitialised-weights transformers causal LM for ``hf_config`` (quantization stripped)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    cfg = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def load_model(model_dir: str, dtype: torch.dtype = torch.float32,
               quantization: str | None = None) -> nn.Module:
    """Load a (possibly quantized) Llama folder into a transformers model on CPU.

    Args:
        model_dir: HF folder (config.json + safetensors).
        dtype: dtype of activations, norms, embeddings and dense weights.
        quantization: ``--quantization`` override (must match the checkpoint).

    Returns:
        ``LlamaForCausalLM`` in eval mode; quantized Linears are nybble modules.

    Raises:
        UnsupportedModelError: unsupported quantization; ValueError: missing/extra tensors.
    """
    hf_config = read_hf_config(model_dir)
    qc = load_quant_config(model_dir, hf_config, quantization)
    model = build_fp_model(hf_config, dtype)
    unfuse_experts(model, hf_config)
    to_model, to_checkpoint = model_name(hf_config), checkpoint_name(hf_config)
    tensors = {to_model(k): v for k, v in load_checkpoint_tensors(model_dir).items()}
    replaced: list[str] = []
    if qc is not None:
        for name, mod in list(model.named_modules()):
            if not isinstance(mod, nn.Linear):
                continue
            new = qc.linear_factory([to_checkpoint(name)], mod.in_features, [mod.out_features],
                                    mod.bias is not None, dtype, torch.device("cpu"))
            if new is None:  # stays dense: the nn.Linear loads through load_state_dict
                continue
            prefix = name + "."
            own = {k[len(prefix):]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
            new.load_tensors(own)
            replaced.append(prefix)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")
               and "rotary_emb" not in m and not any(m.startswith(p) for p in replaced)]
    if missing or unexpected:
        raise ValueError(f"checkpoint tensors must match the model, got missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
    if tied:
        model.tie_weights()
    return model
