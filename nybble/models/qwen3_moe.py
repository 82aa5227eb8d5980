"""Qwen3-MoE (``Qwen3MoeForCausalLM``): the Qwen 3 block (per-head q/k norms) whose MLP is, on
the sparse layers, a mixture of ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``, each token routed to ``num_experts_per_tok`` of them (Qwen team,
"Qwen3 Technical Report", 2025). A layer is sparse unless it is in ``mlp_only_layers`` or
``(layer + 1) % decoder_sparse_step != 0``; the router's top-k probabilities are renormalised
only when ``norm_topk_prob``."""
from __future__ import annotations

import dataclasses

from nybble.errors import UnsupportedModelError
from nybble.models.arch import ArchSpec, MoESpec
from nybble.models.hf_config import HFConfig
from nybble.models.qwen3 import qwen3_spec


def qwen3_moe_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of a Qwen3-MoE config.

    Raises:
        UnsupportedModelError: ``decoder_sparse_step`` below 1 or ``num_experts_per_tok``
            outside ``[1, num_experts]``.
    """
    # NOTE: Qwen's files say num_experts; transformers 5 writes it as num_local_experts
    experts = int(getattr(config, "num_experts", None) or
                  getattr(config, "num_local_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 0)
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                   for i in range(int(config.num_hidden_layers)))
    top_k = int(getattr(config, "num_experts_per_tok", 1))
    if any(sparse) and not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok must be in [1, num_experts = "
                                    f"{experts}], got {top_k}")
    moe = MoESpec(num_experts=experts, top_k=top_k,
                  renormalize=bool(getattr(config, "norm_topk_prob", False)),
                  intermediate_size=int(config.moe_intermediate_size), sparse_layers=sparse,
                  weights_in_logits_dtype=True)
    return dataclasses.replace(qwen3_spec(config), moe=moe if any(sparse) else None)
