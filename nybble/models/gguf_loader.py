"""Load a GGUF file's weights into :class:`~nybble.models.llama.LlamaForCausalLM`.

Names: llama.cpp's tensor names (``token_embd``, ``blk.N.attn_q`` ... ``output``; gguf-py's
``TENSOR_NAMES`` in ``constants.py``, the Hugging Face side in ``tensor_mapping.py``) mapped
onto Hugging Face's. Quantized tensors go straight from their blocks into nybble's packed
integers (:mod:`nybble.quant.gguf_blocks`, :mod:`nybble.quant.gguf_linear`); F32/F16/BF16
tensors are dense. llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of a
``llama`` model per head, Mixtral included (its RoPE rotates adjacent pairs, Hugging Face's the
two halves of a head; ``qwen2``/``qwen3``/``gemma*``/``phi3`` use the halves and are not
permuted); the permutation moves whole rows, so it is undone on the quantized rows before
unpacking. A quantized token embedding is kept quantized: it is the output head when the
embeddings are tied, and the embedding lookup dequantizes only the rows of the step's tokens.

Per family (``convert_hf_to_gguf.py``): Phi-3's ``attn_qkv`` (q, k, v rows) and ``ffn_up``
(gate rows, then up rows) are the fused ``qkv_proj`` / ``gate_up_proj``; Gemma's converter
stores every norm weight as ``w + 1`` (Hugging Face's ``GemmaRMSNorm`` multiplies by
``1 + w``), so ``1`` is taken off; Gemma's sandwich norms are ``post_attention_norm``,
``ffn_norm`` (pre-MLP) and ``post_ffw_norm``. Mixture-of-experts layers store each projection
of all experts stacked, ``blk.N.ffn_{gate,up,down}_exps`` ``[E, I, H]`` / ``[E, H, I]``
(each expert's rows quantized on their own), router ``ffn_gate_inp`` ``[E, H]``: expert ``e``
of a quantized stack is its own quantized linear (nybble's per-expert quantized MoE path,
:class:`~nybble.models.moe.MoEBlock`), a float stack fills the stacked dense experts.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nybble.errors import UnsupportedModelError
from nybble.gguf.reader import GGUFFile, GGUFTensor
from nybble.kernels.reference.quant import IntWeight, dequantize_int_weight
from nybble.models.llama import LlamaForCausalLM
from nybble.models.moe import MoEBlock
from nybble.quant.gguf_blocks import DENSE_TYPES, SUPPORTED_QUANT_TYPES, unpack_blocks
from nybble.quant.gguf_linear import GGUFDensePart, GGUFLinear, GGUFQuantLinear
from nybble.quant.linear import CpuPathLog

logger = logging.getLogger(__name__)

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm"}
_PREFIX = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}
_SANDWICH_NORMS = {"post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}
_KINDS = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q4_K": (4, 32, True),
          "Q5_0": (8, 32, False), "Q5_1": (8, 32, True), "Q5_K": (8, 32, True),
          "Q6_K": (8, 16, False), "Q8_0": (8, 32, False)}


def gguf_name(hf_prefix: str) -> str:
    """The GGUF name of a Hugging Face module prefix (``model.layers.0.self_attn.q_proj`` ->
    ``blk.0.attn_q``; ``model.embed_tokens`` -> ``token_embd``; an expert's projection
    ``model.layers.0.mlp.experts.3.up_proj`` -> its stack ``blk.0.ffn_up_exps``)."""
    e = _EXPERT.fullmatch(hf_prefix)
    if e is not None:
        return f"blk.{e.group(1)}.ffn_{_EXPERT_PART[e.group(3)]}_exps"
    m = _PREFIX.fullmatch(hf_prefix)
    if m is not None and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
            "lm_head": "output"}.get(hf_prefix, hf_prefix)


def expert_index(hf_prefix: str) -> int | None:
    """The expert of an expert projection's prefix (``...experts.3.up_proj`` -> 3), else
    None."""
    e = _EXPERT.fullmatch(hf_prefix)
    return None if e is None else int(e.group(2))


def _tensor(gf: GGUFFile, name: str) -> GGUFTensor:
    t = gf.tensors.get(name)
    if t is None:
        hint = ""
        if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", name):
            hint = (" (experts must be stacked per projection, as llama.cpp's converter writes "
                    "them since 2024; re-convert a file with one tensor per expert)")
        raise UnsupportedModelError(f"GGUF file {gf.path!r} lacks tensor {name!r}{hint}")
    if t.type_name not in SUPPORTED_QUANT_TYPES + DENSE_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor {name} has type {t.type_name}, which nybble does not load; supported: "
            f"{', '.join(SUPPORTED_QUANT_TYPES + DENSE_TYPES)} (requantize the float model with "
            f"llama-quantize to one of them)")
    return t


def dense_array(t: GGUFTensor) -> torch.Tensor:
    """A float GGUF tensor as float32 of its shape (rows first), bit-exact."""
    data = np.ascontiguousarray(t.data)
    if t.type_name == "BF16":
        out = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float()
    else:
        out = torch.from_numpy(data.copy()).float()
    return out.reshape(t.shape)


@dataclass(frozen=True)
class _Source:
    """One Hugging Face weight's data in a GGUF file.

    Attributes:
        tensor: the GGUF tensor (an expert's weight: its stack). shape: ``(N, K)`` of the
            weight itself. value: float32 ``[N, K]`` (float types) or the raw block rows
            ``uint8 [N, bytes per row]`` (quantized types), in Hugging Face row order.
    """

    tensor: GGUFTensor
    shape: tuple[int, ...]
    value: torch.Tensor

    @property
    def type_name(self) -> str:
        return self.tensor.type_name

    def as_float(self) -> torch.Tensor:
        """float32 ``[N, K]`` (quantized rows dequantized exactly as gguf-py does)."""
        if self.type_name in DENSE_TYPES:
            return self.value
        ints = unpack_blocks(self.type_name, self.value, self.shape[-1])
        g = ints.scales.shape[1]
        iw = IntWeight(ints.q.t(), torch.full((g, ints.q.shape[0]), ints.zero,
                                              dtype=torch.int32), None, ints.group_size,
                       ints.bits, None if ints.mins is None else ints.mins.t())
        return dequantize_int_weight(iw, ints.scales.t()).contiguous()


def _source(gf: GGUFFile, prefix: str, suffix: str, heads: int, kv_heads: int) -> _Source:
    """The GGUF data of Hugging Face tensor ``{prefix}.{suffix}`` (``weight``/``bias``)."""
    name = f"{gguf_name(prefix)}.{suffix}"
    t = _tensor(gf, name)
    expert = expert_index(prefix)
    if expert is not None:
        if len(t.shape) != 3 or not 0 <= expert < t.shape[0]:
            raise UnsupportedModelError(f"GGUF tensor {name} must stack the experts [E, rows, "
                                        f"cols] with expert {expert} in it, got {t.shape}")
        shape = tuple(t.shape[1:])
        if t.type_name in DENSE_TYPES:
            return _Source(t, shape, dense_array(t)[expert])
        raw = torch.from_numpy(np.array(np.asarray(t.data).reshape(t.shape[0], shape[0], -1)
                                        [expert]))
        return _Source(t, shape, raw)
    order = _row_order(name, t.shape[0], gf.architecture, heads, kv_heads)
    if t.type_name in DENSE_TYPES:
        w = dense_array(t)
        return _Source(t, t.shape, w if order is None else w[order])
    return _Source(t, t.shape, _rows(t, gf, heads, kv_heads))


class GGUFFactory:
    """The ``LinearFactory`` of a GGUF file: a :class:`GGUFLinear` for every projection with
    a quantized shard (one part per run of equal types), None (dense) otherwise. A fused
    checkpoint projection (Phi-3's ``attn_qkv``: one prefix, several widths) is one shard."""

    def __init__(self, gf: GGUFFile, path_log: CpuPathLog) -> None:
        self.gf, self.path_log = gf, path_log

    def __call__(self, prefixes: list[str], in_features: int, out_features: list[int],
                 bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        types = [_tensor(self.gf, gguf_name(p) + ".weight").type_name for p in prefixes]
        if all(t in DENSE_TYPES for t in types):
            return None
        widths = _shard_widths(prefixes, out_features)
        parts: list[nn.Module] = []
        i = 0
        while i < len(types):
            j = i
            while j + 1 < len(types) and types[j + 1] == types[i]:
                j += 1
            width = sum(widths[i:j + 1])
            if types[i] in DENSE_TYPES:
                parts.append(GGUFDensePart(in_features, width, dtype, device))
            else:
                parts.append(quant_module(types[i], in_features, width, dtype, device,
                                          self.path_log))
            i = j + 1
        module = GGUFLinear(in_features, parts, bias, dtype, device)
        module.part_types = types
        return module


def _shard_widths(prefixes: list[str], widths: list[int]) -> list[int]:
    """Output rows per checkpoint tensor: ``widths``, or their sum for one fused tensor."""
    return list(widths) if len(prefixes) == len(widths) else [sum(widths)]


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
        if isinstance(module, MoEBlock) and module.w13 is not None:
            _load_stacked_experts(module, gf, used)
        prefixes = getattr(module, "shard_prefixes", None)
        if not prefixes:
            continue
        loaded = [_source(gf, p, "weight", heads, kv_heads) for p in prefixes]
        used.update(s.tensor.name for s in loaded)
        widths = _shard_widths(prefixes, module.shard_widths)
        for src, width in zip(loaded, widths):
            if src.shape != (width, module.in_features):
                raise UnsupportedModelError(f"GGUF tensor {src.tensor.name} must have shape "
                                            f"{(width, module.in_features)} (rows, ne0), got "
                                            f"{src.shape}")
        bias = _bias(gf, prefixes, heads, kv_heads, used)
        if isinstance(module, GGUFLinear):
            _fill_parts(module, loaded)
            if module.bias is not None:
                if bias is None:
                    raise UnsupportedModelError(f"GGUF file lacks the biases of "
                                                f"{[gguf_name(p) for p in prefixes]}")
                module.bias.copy_(bias)
        else:   # DenseLinear (a quantized router is dequantized)
            tensors = {"weight": torch.cat([src.as_float() for src in loaded], 0)}
            if bias is not None:
                tensors["bias"] = bias
            module.load_tensors(tensors)
    _load_norms(model, gf, used)
    _load_embedding(model, gf, dtype, path_log, used)
    used.update(n for n in ("rope_factors_long.weight", "rope_factors_short.weight")
                if n in gf.tensors)    # read into the config (nybble.gguf.arch_config)
    extra = sorted(set(gf.tensors) - used)
    if extra:
        logger.warning("ignoring GGUF tensors %s", extra[:5])


def _load_stacked_experts(block: MoEBlock, gf: GGUFFile, used: set[str]) -> None:
    """Float experts: each expert's gate, up and down rows of the stacks into ``block``'s
    ``w13`` / ``w2`` (a quantized stack among float ones is dequantized)."""
    for prefix, (expert, part) in block.expert_prefixes.items():
        src = _source(gf, prefix, "weight", 0, 0)
        used.add(src.tensor.name)
        block.load_expert(expert, part, "weight", src.as_float())


def _bias(gf: GGUFFile, prefixes: list[str], heads: int, kv_heads: int,
          used: set[str]) -> torch.Tensor | None:
    names = [gguf_name(p) for p in prefixes]
    found = [n + ".bias" for n in names if n + ".bias" in gf.tensors]
    if not found:
        return None
    if len(found) != len(names):
        raise UnsupportedModelError(f"GGUF file must hold biases for all or none of {names}")
    used.update(found)
    return torch.cat([_source(gf, p, "bias", heads, kv_heads).as_float().reshape(-1)
                      for p in prefixes])


def _fill_parts(module: GGUFLinear, loaded: list[_Source]) -> None:
    i = 0
    for part in module.parts:
        rows, group = 0, []
        while rows < part.out_features:
            group.append(loaded[i])
            rows += loaded[i].shape[0]
            i += 1
        if isinstance(part, GGUFDensePart):
            part.load_weight(torch.cat([src.value for src in group], 0))
            continue
        raw = torch.cat([src.value for src in group], 0)
        part.load_ints(unpack_blocks(group[0].type_name, raw, module.in_features))


def _norm_names(model: LlamaForCausalLM, i: int) -> list[tuple[nn.Module, str]]:
    """Layer ``i``'s norms and their GGUF names."""
    layer = model.layers[i]
    attrs = ["input_layernorm", "post_attention_layernorm"]
    if layer.sandwich:
        attrs += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    out = [(getattr(layer, a), f"blk.{i}." + (_SANDWICH_NORMS.get(a) if layer.sandwich and
                                                a in _SANDWICH_NORMS else _LAYER[a]))
           for a in attrs]
    attn = layer.self_attn
    if attn.q_norm is not None and attn.k_norm is not None:
        out += [(attn.q_norm, f"blk.{i}.attn_q_norm"), (attn.k_norm, f"blk.{i}.attn_k_norm")]
    return out


def _load_norms(model: LlamaForCausalLM, gf: GGUFFile, used: set[str]) -> None:
    """Every RMSNorm weight; Gemma's stored ``w + 1`` becomes the ``w`` of ``1 + w``."""
    shift = 1.0 if model.spec.gemma_norm else 0.0
    pairs = [p for i in range(len(model.layers)) for p in _norm_names(model, i)]
    for module, gname in pairs + [(model.norm, "output_norm")]:
        name = gname + ".weight"
        w = dense_array(_tensor(gf, name))
        if w.shape != module.weight.shape:
            raise UnsupportedModelError(f"GGUF tensor {name} must have shape "
                                        f"{tuple(module.weight.shape)}, got {tuple(w.shape)}")
        module.weight.data.copy_(w - shift if shift else w)
        used.add(name)


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
