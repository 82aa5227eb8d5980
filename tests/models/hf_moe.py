"""Tiny randomly initialised Qwen3-MoE and Mixtral checkpoints written by transformers from its
own config classes (float32), with routers made to tie so that top-k tie-breaking shows."""
from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from .hf_families import WINDOW, random_model, save_with_tokenizer

MOE_FAMILIES = {
    # 8 experts, top-2 not renormalised, layer 1 dense (mlp_only_layers), GQA 4:1
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1)),
    # top-3 renormalised, every second layer sparse (decoder_sparse_step 2), tied embeddings
    "qwen3-moe-norm": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                       dict(num_hidden_layers=4, num_key_value_heads=4, num_experts=6,
                            num_experts_per_tok=3, moe_intermediate_size=24,
                            norm_topk_prob=True, decoder_sparse_step=2,
                            tie_word_embeddings=True)),
    # 4 experts top-2 renormalised, every layer sliding, w1/w2/w3 names
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=48, sliding_window=WINDOW, tie_word_embeddings=False)),
}


def _routers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The router weights ``[E, H]`` of every sparse layer."""
    return [m.weight for n, m in model.named_modules() if n.endswith(("mlp.gate",
                                                                      "block_sparse_moe.gate"))]


def make_moe_model(name: str, root: str, seed: int = 0) -> str:
    """Write variant ``name`` under ``root``: random weights, norms perturbed, routers scaled
    up so routing is decisive, and in every router experts 0 and 1 given the same row (their
    probabilities tie exactly; which one top-k keeps decides the output); bundled tokenizer
    files. Its folder."""
    model = random_model(*MOE_FAMILIES[name], seed)
    with torch.no_grad():
        routers = _routers(model)
        assert routers, "the variant must have sparse layers"
        for w in routers:
            w.normal_(0, 0.5)
            w[1] = w[0]
    return save_with_tokenizer(model, root, name)
