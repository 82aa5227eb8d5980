"""Tiny random Qwen3 / Qwen3-MoE / Mixtral / Gemma 2 / Gemma 3 / Phi-3 models written as GGUF
files the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (names from gguf-py's
``TENSOR_NAMES``, the metadata keys its ``*Model.set_gguf_parameters`` writes, ``attn_q`` /
``attn_k`` rows permuted per head for ``llama``, Gemma norms stored as ``w + 1``, experts
stacked per projection, Phi-3's LongRoPE factors as tensors), with the stories3m fixture's
tokenizer (512 tokens).

Written independently of nybble's loader: the name table below is the converter's, checked
against gguf-py's per-architecture tensor lists.
"""
from __future__ import annotations

import math
import os
import re

import gguf
import numpy as np
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.conftest import shared_path
from tests.models.hf_families import FAMILIES, WINDOW, random_model
from tests.models.hf_moe import _routers

STORIES = os.path.join(shared_path("fixtures", "gguf"), "stories3m-F32.gguf")

GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
"""llama.cpp's Gemma 3 pattern (five local layers, then a global one) over seven layers."""

# name -> (GGUF architecture, transformers config class, model class, config arguments)
GGUF_FAMILIES = {
    # q/k norms, head_dim 16 != hidden / heads, GQA 4:1, untied head
    "qwen3": ("qwen3", Qwen3Config, Qwen3ForCausalLM,
              dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    # fused qkv / gate_up, LongRoPE, half-rotary heads, window on every layer
    "phi3": ("phi3", Phi3Config, Phi3ForCausalLM, FAMILIES["phi3"][2]),
    # soft-capping, window on even layers; query_pre_attn_scalar = head_dim (llama.cpp's rule
    # below 46 layers) while hidden / heads = 8
    "gemma2": ("gemma2", Gemma2Config, Gemma2ForCausalLM,
               dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                    sliding_window=WINDOW, attn_logit_softcapping=2.0,
                    final_logit_softcapping=5.0, pad_token_id=0)),
    # q/k (1 + w) norms, local 10k / global 1M linear x2 RoPE, llama.cpp's 5:1 layer pattern
    "gemma3": ("gemma3", Gemma3TextConfig, Gemma3ForCausalLM,
               dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                    num_hidden_layers=7, sliding_window=WINDOW, pad_token_id=0,
                    layer_types=GEMMA3_LAYERS,
                    rope_parameters={"sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1000000.0}})),
    # 8 experts top-2, renormalised (llama.cpp's assumption), every layer sparse (llama.cpp's
    # qwen3moe has no dense layer)
    "qwen3-moe": ("qwen3moe", Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                       decoder_sparse_step=1)),
    # llama with experts: 4 experts top-2, q/k permuted, untied
    "mixtral": ("llama", MixtralConfig, MixtralForCausalLM,
                dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=64, sliding_window=None, tie_word_embeddings=False)),
}

TRANSFORMERS_GGUF = {
    # transformers' GGUF config mapping reads no key_length for qwen3 (head_dim stays the
    # config default 128) and no expert_feed_forward_length for qwen3moe (768): variants with
    # those widths are the ones its loader reads faithfully
    "qwen3-tf": ("qwen3", Qwen3Config, Qwen3ForCausalLM,
                 dict(num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)),
    "qwen3-moe-tf": ("qwen3moe", Qwen3MoeConfig, Qwen3MoeForCausalLM,
                     dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1)),
}
"""Variants whose files transformers' own GGUF loader (``gguf_file=``) reads faithfully."""

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The transformers model of variant ``name``: random weights, norms perturbed, MoE routers
    decisive with experts 0 and 1 tied (as :func:`tests.models.hf_moe.make_moe_model`)."""
    _, config_cls, model_cls, extra = {**GGUF_FAMILIES, **TRANSFORMERS_GGUF}[name]
    model = random_model(config_cls, model_cls, extra, seed)
    with torch.no_grad():
        for w in _routers(model):
            w.normal_(0, 0.5)
            w[1] = w[0]
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rows of each head interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


Link = tuple[str, object, str, int]
"""(Hugging Face state-dict key, index into it, GGUF name, heads permuted over or 0)."""


def gguf_tensors(model: torch.nn.Module, arch: str
                 ) -> tuple[dict[str, np.ndarray], list[Link]]:
    """The float32 GGUF tensors (name -> rows-first array) of ``model`` as the converter
    writes them for ``arch``, and where each matrix came from in ``model``."""
    cfg = model.config
    gemma = arch.startswith("gemma")
    out: dict[str, np.ndarray] = {}
    links: list[Link] = []
    for key, value in model.state_dict().items():
        w = value.detach().float().numpy().copy()
        if key == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = w
                links.append((key, slice(None), "output.weight", 0))
            continue
        heads = 0
        if key in ("model.embed_tokens.weight", "model.norm.weight"):
            gname = "token_embd.weight" if "embed" in key else "output_norm.weight"
        else:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", key) or \
                re.fullmatch(r"model\.layers\.(\d+)\.(mlp\.experts\.\w+)", key)
            assert m is not None, key
            i, part = m.group(1), m.group(2)
            if part == "mlp.experts.gate_up_proj":      # [E, 2I, H]: gate rows, then up rows
                half = w.shape[1] // 2
                for gname, index in ((f"blk.{i}.ffn_gate_exps.weight", slice(0, half)),
                                     (f"blk.{i}.ffn_up_exps.weight", slice(half, None))):
                    out[gname] = w[:, index].copy()
                    links.append((key, (slice(None), index), gname, 0))
                continue
            if part == "mlp.experts.down_proj":
                gname = f"blk.{i}.ffn_down_exps.weight"
            elif part == "post_attention_layernorm":
                gname = f"blk.{i}." + ("post_attention_norm" if gemma else "ffn_norm") + \
                    ".weight"
            else:
                gname = f"blk.{i}.{_LAYER_NAMES[part]}.weight"
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if "q_proj" in part else cfg.num_key_value_heads
                w = _permute(w, heads)
        if gemma and key.endswith("norm.weight"):
            w = w + 1.0          # the converter's Gemma norm shift
        out[gname] = w
        links.append((key, slice(None), gname, heads))
    if arch == "phi3":
        rope = cfg.rope_parameters
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    _check_names(out, arch, cfg.num_hidden_layers)
    return out, links


def _check_names(tensors: dict[str, np.ndarray], arch: str, layers: int) -> None:
    """Every name is one gguf-py lists for ``arch``."""
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight"
               for t in gguf.MODEL_TENSORS[arch_id] for i in range(layers)}
    bad = sorted(set(tensors) - allowed)
    assert not bad, bad


def _quantizable(name: str, w: np.ndarray) -> bool:
    """llama.cpp's choice: matrices and expert stacks, never norms, rope factors or the
    router (``ffn_gate_inp``)."""
    return w.ndim >= 2 and "norm" not in name and "ffn_gate_inp" not in name \
        and w.shape[-1] % 32 == 0


def quantize_in_place(model: torch.nn.Module, tensors: dict[str, np.ndarray],
                      links: list[Link], qtype: gguf.GGMLQuantizationType
                      ) -> dict[str, np.ndarray]:
    """Quantize the matrices of ``tensors`` with gguf-py (name -> raw blocks) and set
    ``model``'s weights to gguf-py's dequantization of the same blocks (rows back in Hugging
    Face order), so ``model`` is the reference of the quantized file."""
    raw: dict[str, np.ndarray] = {}
    sd = model.state_dict()
    with torch.no_grad():
        for key, index, name, heads in links:
            w = tensors[name]
            if not _quantizable(name, w):
                continue
            raw[name] = gguf.quants.quantize(w, qtype)
            deq = gguf.quants.dequantize(raw[name], qtype).reshape(w.shape)
            if heads:
                d = deq.shape[0] // heads // 2
                deq = deq.reshape(heads, d, 2, -1).swapaxes(1, 2).reshape(deq.shape)
            sd[key][index] = torch.from_numpy(np.ascontiguousarray(deq))
    return raw


def _metadata(writer: gguf.GGUFWriter, model: torch.nn.Module, arch: str) -> None:
    """The keys ``convert_hf_to_gguf.py`` writes for ``arch`` (values from the config)."""
    cfg = model.config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    w = writer
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = cfg.rope_parameters
    if arch in ("qwen3", "qwen3moe", "llama"):
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        orig = rope.get("original_max_position_embeddings",
                        cfg.original_max_position_embeddings)
        rot_pct = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(int(rot_pct * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))


def _tokenizer(writer: gguf.GGUFWriter) -> None:
    """The stories3m fixture's tokenizer keys (llama SentencePiece, 512 tokens)."""
    r = gguf.GGUFReader(STORIES)
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            vtype = f.types[0]
            writer.add_key_value(key, f.contents(), vtype,
                                 f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)


def write_gguf(model: torch.nn.Module, path: str, arch: str,
               qtype: gguf.GGMLQuantizationType | None = None) -> str:
    """Write ``model`` to ``path`` as GGUF ``arch`` (F32, or its matrices as ``qtype``: then
    ``model``'s weights become gguf-py's dequantization of them); ``path``."""
    tensors, links = gguf_tensors(model, arch)
    raw = quantize_in_place(model, tensors, links, qtype) if qtype is not None else {}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    _metadata(writer, model, arch)
    _tokenizer(writer)
    for name, w in tensors.items():
        if name in raw:
            writer.add_tensor(name, raw[name], raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
