"""Load a GGUF file's weights into :class:`~nybble.models.llama.LlamaForCausalLM`.

Names: llama.cpp's tensor names (``token_embd``, ``blk.N.attn_q`` ... ``output``; gguf-py's
``TENSOR_NAMES``) mapped onto Hugging Face's. Quantized tensors go straight from their
blocks into nybble's packed integers (:mod:`nybble.quant.gguf_blocks`,
:mod:`nybble.quant.gguf_linear`); F32/F16/BF16 tensors are dense. llama.cpp's converter
permutes the rows of ``attn_q``/``attn_k`` of a ``llama`` model per head (its RoPE rotates
adjacent pairs, Hugging Face's the two halves of a head); the permutation moves whole rows,
so it is undone on the quantized rows before unpacking. A quantized token embedding is kept
quantized: it is the output head when the embeddings are tied, and the embedding lookup
dequantizes only the rows of the step's tokens.
"""
from __future__ import annotations

import logging
import re

import numpy as np
import torch
from torch import nn

from nybble.errors import UnsupportedModelError
from nybble.gguf.reader import GGUFFile, GGUFTensor
from nybble.models.llama import LlamaForCausalLM
from nybble.quant.gguf_blocks import DENSE_TYPES, SUPPORTED_QUANT_TYPES, unpack_blocks
from nybble.quant.gguf_linear import GGUFDensePart, GGUFLinear, GGUFQuantLinear
from nybble.quant.linear import CpuPathLog

logger = logging.getLogger(__name__)

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}
_PREFIX = re.compile(r"model\.layers\.(\d+)\.(.+)")
_KINDS = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q4_K": (4, 32, True),
          "Q5_0": (8, 32, False), "Q5_1": (8, 32, True), "Q5_K": (8, 32, True),
          "Q6_K": (8, 16, False), "Q8_0": (8, 32, False)}


def gguf_name(hf_prefix: str) -> str:
    """The GGUF name of a Hugging Face module prefix (``model.layers.0.self_attn.q_proj`` ->
    ``blk.0.attn_q``; ``model.embed_tokens`` -> ``token_embd``)."""
    m = _PREFIX.fullmatch(hf_prefix)
    if m is not None and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
            "lm_head": "output"}.get(hf_prefix, hf_prefix)


def _tensor(gf: GGUFFile, name: str) -> GGUFTensor:
    t = gf.tensors.get(name)
    if t is None:
        raise UnsupportedModelError(f"GGUF file {gf.path!r} lacks tensor {name!r}")
    if t.type_name not in SUPPORTED_QUANT_TYPES + DENSE_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {name} has type {t.type_name}, which nybble does not load; supported: "
            f"{', '.join(SUPPORTED_QUANT_TYPES + DENSE_TYPES)} (requantize the float model with "
            f"llama-quantize to one of them)")
    return t


def dense_array(t: GGUFTensor) -> torch.Tensor:
    """A float GGUF tensor as float32 ``[rows, ne0]`` (or ``[ne0]``), bit-exact."""
    data = np.ascontiguousarray(t.data)
    if t.type_name == "BF16":
        out = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
    else:
        out = torch.from_numpy(data.copy()).float()
    return out.reshape(t.shape)


class GGUFFactory:
    """The ``LinearFactory`` of a GGUF file: a :class:`GGUFLinear` for every projection with
    a quantized shard (one part per run of equal types), None (dense) otherwise."""

    def __init__(self, gf: GGUFFile, path_log: CpuPathLog) -> None:
        self.gf, self.path_log = gf, path_log

    def __call__(self, prefixes: list[str], in_features: int, out_features: list[int],
                 bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        types = [_tensor(self.gf, gguf_name(p) + ".weight").type_name for p in prefixes]
        if all(t in DENSE_TYPES for t in types):
            return None
        parts: list[nn.Module] = []
        i = 0
        while i < len(types):
            j = i
            while j + 1 < len(types) and types[j + 1] == types[i]:
                j += 1
            width = sum(out_features[i:j + 1])
            if types[i] in DENSE_TYPES:
                parts.append(GGUFDensePart(in_features, width, dtype, device))
            else:
                parts.append(quant_module(types[i], in_features, width, dtype, device,
                                          self.path_log))
            i = j + 1
        module = GGUFLinear(in_features, parts, bias, dtype, device)
        module.part_types = types
        return module


def quant_module(type_name: str, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, path_log: CpuPathLog) -> GGUFQuantLinear:
    """An empty :class:`GGUFQuantLinear` for ``type_name``."""
    bits, gs, mins = _KINDS[type_name]
    return GGUFQuantLinear(in_features, out_features, dtype, device, type_name, bits, gs, mins,
                           path_log)


def _row_order(name: str, rows: int, arch: str, heads: int, kv_heads: int) -> torch.Tensor | None:
    """The rows of a GGUF ``attn_q``/``attn_k`` in Hugging Face order (llama only): within a
    head, GGUF row ``2i + j`` is HF row ``j * D/2 + i``."""
    if arch != "llama" or not name.endswith((".attn_q.weight", ".attn_k.weight",
                                             ".attn_q.bias", ".attn_k.bias")):
        return None
    h = heads if ".attn_q." in name else kv_heads
    return torch.arange(rows).reshape(h, rows // h // 2, 2).transpose(1, 2).reshape(-1)


def _rows(t: GGUFTensor, gf: GGUFFile, heads: int, kv_heads: int) -> torch.Tensor:
    """The raw data of ``t`` as ``[rows, ...]`` with llama's q/k row permutation undone."""
    data = torch.from_numpy(np.array(t.data))   # a copy: the file is mapped read-only
    if t.type_name == "BF16" or t.type_name not in DENSE_TYPES:
        data = data.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
    order = _row_order(t.name, t.shape[0], gf.architecture, heads, kv_heads)
    return data if order is None else data[order]


def _weight_rows(gf: GGUFFile, name: str, heads: int, kv_heads: int) -> tuple[GGUFTensor,
                                                                              torch.Tensor]:
    """``(tensor, value)``: float32 ``[N, K]`` for float types, the raw block rows else
    (both in HF row order)."""
    t = _tensor(gf, name)
    order = _row_order(name, t.shape[0], gf.architecture, heads, kv_heads)
    if t.type_name in DENSE_TYPES:
        w = dense_array(t)
        return t, (w if order is None else w[order])
    return t, _rows(t, gf, heads, kv_heads)


def load_gguf_weights(model: LlamaForCausalLM, gf: GGUFFile, dtype: torch.dtype,
                      path_log: CpuPathLog) -> None:
    """Fill ``model`` from ``gf`` (built with :class:`GGUFFactory`).

    Raises:
        UnsupportedModelError: a missing tensor, an unsupported type (named with the tensor)
            or a shape that does not fit the config.
    """
    heads, kv_heads = model.shape.num_heads, model.shape.num_kv_heads
    used: set[str] = set()
    for mname, module in model.named_modules():
        prefixes = getattr(module, "shard_prefixes", None)
        if not prefixes:
            continue
        names = [gguf_name(p) for p in prefixes]
        loaded = [_weight_rows(gf, n + ".weight", heads, kv_heads) for n in names]
        used.update(n + ".weight" for n in names)
        for (t, _), width in zip(loaded, module.shard_widths):
            if t.shape != (width, module.in_features):
                raise UnsupportedModelError(f"GGUF tensor {t.name} must have shape "
                                            f"{(width, module.in_features)} (rows, ne0), got "
                                            f"{t.shape}")
        bias = _bias(gf, names, heads, kv_heads, used)
        if isinstance(module, GGUFLinear):
            _fill_parts(module, loaded)
            if module.bias is not None:
                if bias is None:
                    raise UnsupportedModelError(f"GGUF file lacks the biases of {names}")
                module.bias.copy_(bias)
        else:   # DenseLinear
            tensors = {"weight": torch.cat([w for _, w in loaded], 0)}
            if bias is not None:
                tensors["bias"] = bias
            module.load_tensors(tensors)
    _load_norms(model, gf, used)
    _load_embedding(model, gf, dtype, path_log, used)
    extra = sorted(set(gf.tensors) - used)
    if extra:
        logger.warning("ignoring GGUF tensors %s", extra[:5])


def _bias(gf: GGUFFile, names: list[str], heads: int, kv_heads: int,
          used: set[str]) -> torch.Tensor | None:
    found = [n + ".bias" for n in names if n + ".bias" in gf.tensors]
    if not found:
        return None
    if len(found) != len(names):
        raise UnsupportedModelError(f"GGUF file must hold biases for all or none of {names}")
    used.update(found)
    return torch.cat([_weight_rows(gf, n, heads, kv_heads)[1].reshape(-1) for n in found])


def _fill_parts(module: GGUFLinear, loaded: list[tuple[GGUFTensor, torch.Tensor]]) -> None:
    i = 0
    for part in module.parts:
        rows, group = 0, []
        while rows < part.out_features:
            group.append(loaded[i])
            rows += loaded[i][0].shape[0]
            i += 1
        if isinstance(part, GGUFDensePart):
            part.load_weight(torch.cat([w for _, w in group], 0))
            continue
        raw = torch.cat([w for _, w in group], 0)
        part.load_ints(unpack_blocks(group[0][0].type_name, raw, module.in_features))


def _load_norms(model: LlamaForCausalLM, gf: GGUFFile, used: set[str]) -> None:
    for i, layer in enumerate(model.layers):
        for attr, gname in (("input_layernorm", "attn_norm"), ("post_attention_layernorm",
                                                               "ffn_norm")):
            name = f"blk.{i}.{gname}.weight"
            getattr(layer, attr).weight.data.copy_(dense_array(_tensor(gf, name)))
            used.add(name)
    model.norm.weight.data.copy_(dense_array(_tensor(gf, "output_norm.weight")))
    used.add("output_norm.weight")


def _load_embedding(model: LlamaForCausalLM, gf: GGUFFile, dtype: torch.dtype,
                    path_log: CpuPathLog, used: set[str]) -> None:
    """Token embedding and head: dense parameters, or quantized modules
    (``model.quant_embed`` / ``model.quant_head``)."""
    emb = _tensor(gf, "token_embd.weight")
    hidden = model.config.hidden_size
    used.add(emb.name)
    device = model.embed_tokens.weight.device
    if emb.type_name in DENSE_TYPES:
        model.embed_tokens.weight.data.copy_(dense_array(emb).to(dtype))
        embed_q = None
    else:
        embed_q = quant_module(emb.type_name, hidden, emb.shape[0], dtype, device, path_log)
        embed_q.load_ints(unpack_blocks(emb.type_name, _rows(emb, gf, 0, 0), hidden))
        model.embed_tokens.weight = nn.Parameter(torch.empty(0, hidden, dtype=dtype,
                                                             device=device),
                                                 requires_grad=False)
    head_q = embed_q if model.tie_word_embeddings else None
    if not model.tie_word_embeddings:
        out = _tensor(gf, "output.weight")
        used.add(out.name)
        if out.type_name in DENSE_TYPES:
            assert model.lm_head is not None
            model.lm_head.data.copy_(dense_array(out).to(dtype))
        else:
            head_q = quant_module(out.type_name, hidden, out.shape[0], dtype, device, path_log)
            head_q.load_ints(unpack_blocks(out.type_name, _rows(out, gf, 0, 0), hidden))
            model.lm_head = None
    model.set_quantized_vocab(embed_q, head_q)
