"""Tiny randomly initialised Qwen3 / Phi-3 / Gemma 2 / Gemma 3 checkpoints written by
transformers from its own config classes, with windows shorter than the test prompts."""
from __future__ import annotations

import os
import shutil

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nybble.config import DEFAULT_MODEL

from .hf_tiny import _COMMON
WINDOW = 8
"""The sliding window of the windowed variants (tokens): shorter than most test prompts."""

FAMILIES = {
    # per-head q/k norm, head_dim != hidden / heads, GQA 4:1, layer 1 sliding
    "qwen3": (Qwen3Config, Qwen3ForCausalLM,
              dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                   use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # qk norm on a plain causal Qwen3, tied embeddings
    "qwen3-full": (Qwen3Config, Qwen3ForCausalLM,
                   dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # fused qkv / gate_up, LongRoPE (short factors below 64 positions), half-rotary heads,
    # every layer sliding
    "phi3": (Phi3Config, Phi3ForCausalLM,
             dict(num_key_value_heads=4, sliding_window=WINDOW, partial_rotary_factor=0.5,
                  original_max_position_embeddings=64, pad_token_id=0,
                  rope_scaling={"rope_type": "longrope",
                                "short_factor": [1.0, 1.1], "long_factor": [2.0, 3.0]})),
    # soft-capping strong enough to matter, query_pre_attn_scalar != head_dim, local/global
    "gemma2": (Gemma2Config, Gemma2ForCausalLM,
               dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                    sliding_window=WINDOW, attn_logit_softcapping=2.0,
                    final_logit_softcapping=5.0, pad_token_id=0)),
    # q/k (1 + w) norms, local (10k) and global (1M, linear x2) RoPE tables
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM,
               dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                    num_hidden_layers=3, sliding_window=WINDOW, pad_token_id=0,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1000000.0}})),
}


def make_family_model(name: str, root: str, seed: int = 0) -> str:
    """Write variant ``name`` under ``root`` (random weights, norms perturbed so that a
    wrong norm form shows, bundled tokenizer files); its folder."""
    return save_with_tokenizer(random_model(*FAMILIES[name], seed), root, name)


def random_model(config_cls: type, model_cls: type, extra: dict, seed: int
                 ) -> torch.nn.Module:
    """A transformers ``model_cls`` of ``config_cls(**_COMMON, **extra)`` with random weights
    (``seed``), its norms perturbed so that a wrong norm form shows."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_COMMON, **extra})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def save_with_tokenizer(model: torch.nn.Module, root: str, name: str) -> str:
    """``model.save_pretrained`` into ``root/name`` (safetensors) with the bundled model's
    tokenizer files; the folder."""
    path = os.path.join(root, name)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL, f), path)
    return path
