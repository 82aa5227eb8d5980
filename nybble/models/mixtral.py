"""Mixtral (``MixtralForCausalLM``): a Mistral block whose every MLP is a sparse mixture of
``num_local_experts`` SwiGLU experts of width ``intermediate_size``, each token routed to
``num_experts_per_tok`` of them with the chosen router probabilities renormalised to sum to 1
(Jiang et al., "Mixtral of Experts", 2024; routing as in the Switch Transformer, Fedus et al.
2021, with top-2). The checkpoint names the block ``block_sparse_moe`` and an expert's gate,
up and down projections ``w1``, ``w3`` and ``w2``."""
from __future__ import annotations

from nybble.errors import UnsupportedModelError
from nybble.models.arch import ArchSpec, MoESpec, sliding_windows
from nybble.models.hf_config import HFConfig


def mixtral_spec(config: HFConfig) -> ArchSpec:
    """The :class:`ArchSpec` of a Mixtral config.

    Raises:
        UnsupportedModelError: ``num_experts_per_tok`` outside ``[1, num_local_experts]``.
    """
    experts = int(config.num_local_experts)
    top_k = int(config.num_experts_per_tok)
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok must be in [1, num_local_experts = "
                                    f"{experts}], got {top_k}")
    moe = MoESpec(num_experts=experts, top_k=top_k, renormalize=True,
                  intermediate_size=int(config.intermediate_size),
                  sparse_layers=(True,) * int(config.num_hidden_layers),
                  block="block_sparse_moe", projections=("w1", "w3", "w2"))
    return ArchSpec(windows=sliding_windows(config), moe=moe)
