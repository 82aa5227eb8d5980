"""Mixture-of-experts routing and expert computation in plain torch: the CPU path and the
oracle of the Triton kernel (:mod:`nybble.kernels.triton.fused_moe`).

A sparse MoE layer (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; Mixtral, Jiang
et al. 2024; Qwen3 technical report, 2025) sends each token to ``top_k`` of ``E`` experts, each
a SwiGLU MLP, and sums their outputs weighted by the router's probabilities:

* :func:`route_topk`: ``softmax`` of the router logits in float32, ``torch.topk``, optionally
  renormalised over the chosen experts (transformers' order of operations, so ties break the
  same way);
* :func:`sort_by_expert`: the ``T * top_k`` (token, slot) pairs ordered by expert, and each
  expert's count;
* :func:`grouped_experts`: one call of an expert function per expert on its gathered tokens
  (a loop over experts, never over tokens), the weighted outputs summed into their tokens
  with ``index_add_``;
* :func:`fused_experts`: the same with the experts' weights stacked, ``w13 [E, 2I, H]`` (gate
  rows, then up rows) and ``w2 [E, H, I]``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

ACTIVATIONS = ("silu",)
"""The experts' gated activations: ``silu(gate) * up`` (SwiGLU, Shazeer 2020)."""


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights.

    ``softmax(router_logits)`` in float32, the ``top_k`` largest probabilities by
    ``torch.topk`` (ties: the order torch.topk gives, as in transformers), divided by their
    sum when ``renormalize`` (Mixtral always; Qwen3-MoE when ``norm_topk_prob``).

    Args:
        router_logits: ``[T, E]`` any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: make each token's ``top_k`` weights sum to 1.
        weights_dtype: dtype of the returned weights (None: float32; Qwen3-MoE casts them to
            the logits' dtype, Mixtral keeps float32).

    Returns:
        ``(weights [T, top_k], expert_ids [T, top_k] int64)``, each row in decreasing weight.

    Raises:
        ValueError: ``top_k`` outside ``[1, E]``.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), "
                         f"got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat (token, slot) pairs grouped by expert.

    Args:
        expert_ids: ``[T, top_k]`` int, values in ``[0, num_experts)``.

    Returns:
        ``(order [T * top_k] int64, counts [num_experts] int64)``: ``order`` lists the flat
        indices ``t * top_k + slot`` expert by expert (a stable sort: tokens ascending within
        an expert); expert ``e``'s pairs are ``order[sum(counts[:e]):sum(counts[:e + 1])]``.

    Raises:
        ValueError: an expert id outside ``[0, num_experts)``.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts}), got "
                         f"[{int(flat.min())}, {int(flat.max())}]")
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``(expert, x [n, H]) -> [n, H]``: one expert's MLP on its gathered tokens."""


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                    num_experts: int, expert: ExpertFn) -> torch.Tensor:
    """``sum_j weights[t, j] * expert(expert_ids[t, j], x[t])`` for every token ``t``.

    Each expert with tokens is called once on all of them (gathered in token order); its
    outputs, times their weights and cast to ``x.dtype``, are added into their tokens' rows
    with ``index_add_``, expert after expert in increasing id (transformers' order).

    Args:
        x: ``[T, H]``. weights: ``[T, top_k]`` (float32 or ``x.dtype``).
        expert_ids: ``[T, top_k]`` int in ``[0, num_experts)``.
        expert: the expert function (:data:`ExpertFn`).

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: ``weights`` and ``expert_ids`` of different shapes, or a row count that
            differs from ``x``'s.
    """
    if weights.shape != expert_ids.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"weights and expert_ids must both be [{x.shape[0]}, top_k], got "
                         f"{tuple(weights.shape)} and {tuple(expert_ids.shape)}")
    top_k = expert_ids.shape[1]
    order, counts = sort_by_expert(expert_ids, num_experts)
    flat_weights = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        y = expert(e, x.index_select(0, tokens))
        out.index_add_(0, tokens, (y * flat_weights[pairs, None]).to(x.dtype))
    return out


def gated(h: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(h[:, :I]) * h[:, I:]`` of a fused gate/up output ``h [n, 2I]`` -> ``[n, I]``.

    Raises:
        ValueError: an activation not in :data:`ACTIVATIONS`.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got "
                         f"{activation!r}")
    inter = h.shape[-1] // 2
    return F.silu(h[:, :inter]) * h[:, inter:]


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  expert_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The MoE layer's expert part with stacked weights (torch reference).

    Expert ``e`` computes ``act(x @ w13[e, :I].T) * (x @ w13[e, I:].T) @ w2[e].T``; the
    outputs are combined as in :func:`grouped_experts`.

    Args:
        x: ``[T, H]`` float. w13: ``[E, 2I, H]`` (gate rows then up rows), same dtype.
        w2: ``[E, H, I]``. weights, expert_ids: ``[T, top_k]`` (:func:`route_topk`).
        activation: one of :data:`ACTIVATIONS`.

    Returns:
        ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: shapes that do not fit together, or an unknown activation.
    """
    num_experts, two_inter, hidden = w13.shape
    if (x.shape[-1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2)
            or two_inter % 2):
        raise ValueError(f"x [T, H], w13 [E, 2I, H] and w2 [E, H, I] must agree, got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        return gated(xe @ w13[e].t(), activation) @ w2[e].t()
    return grouped_experts(x, weights, expert_ids, num_experts, expert)
