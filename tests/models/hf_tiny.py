"""Tiny randomly initialised Llama / Mistral / Qwen2 checkpoints written by transformers."""
from __future__ import annotations

import os
import shutil

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from nybble.config import DEFAULT_MODEL

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=8, max_position_embeddings=256, bos_token_id=1,
               eos_token_id=2, rms_norm_eps=1e-6)

VARIANTS = {
    # GQA 4:1, untied head
    "llama-gqa": (LlamaConfig, LlamaForCausalLM,
                  dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # llama3 rope scaling, tied embeddings, attention bias, no GQA
    "llama3-rope": (LlamaConfig, LlamaForCausalLM,
                    dict(num_key_value_heads=8, tie_word_embeddings=True, attention_bias=True,
                         rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32})),
    "mistral": (MistralConfig, MistralForCausalLM,
                dict(num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False)),
    # q/k/v bias, tied embeddings, GQA 8:1
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False)),
}


def make_tiny_model(name: str, root: str, seed: int = 0, **overrides) -> str:
    """Write variant ``name`` (random weights, bundled tokenizer files) under ``root``;
    ``overrides`` replace config fields (e.g. ``hidden_size``, ``head_dim``)."""
    config_cls, model_cls, extra = VARIANTS[name]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    # Make biases non-zero so a bias that is dropped shows up in the logits.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)
    path = os.path.join(root, name)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL, f), path)
    return path
