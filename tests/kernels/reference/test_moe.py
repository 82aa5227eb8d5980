"""The torch MoE reference against a per-token float64 oracle written from the definition
(each token: softmax, top-k, optional renormalisation, the weighted sum of its experts'
SwiGLU outputs), and its errors."""
from __future__ import annotations

import pytest
import torch

from nybble.kernels import moe_ops
from nybble.kernels.reference.moe import (fused_experts, gated, grouped_experts, route_topk,
                                          sort_by_expert)


def _oracle(x, w13, w2, logits, top_k, renormalize):  # type: ignore[no-untyped-def]
    """Token by token in float64 (the router's softmax and renormalisation in float32, as
    the definition says)."""
    x, w13, w2, logits = (t.double() for t in (x, w13, w2, logits))
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].float(), -1)
        chosen = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        top = probs[chosen]
        top = (top / top.sum() if renormalize else top).double()
        for e, weight in zip(chosen, top):
            h = w13[e] @ x[t]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weight * (w2[e] @ a)
    return out


def _problem(tokens: int, experts: int, hidden: int, inter: int,  # type: ignore[no-untyped-def]
             seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64) * 2
    return x, w13, w2, logits


@pytest.mark.parametrize("tokens,experts,top_k,renormalize",
                         [(1, 4, 1, False), (7, 4, 2, True), (33, 8, 2, False),
                          (20, 6, 3, True), (5, 16, 4, False)])
def test_fused_experts_equal_the_per_token_oracle(tokens, experts, top_k, renormalize) -> None:
    x, w13, w2, logits = _problem(tokens, experts, 24, 16)
    weights, ids = route_topk(logits, top_k, renormalize, torch.float64)
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, _oracle(x, w13, w2, logits, top_k, renormalize),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moe_ops.fused_experts(x, w13, w2, weights, ids), got,
                               rtol=0, atol=0)   # on the CPU the dispatcher is the reference


def test_float32_is_close_to_float64() -> None:
    x, w13, w2, logits = _problem(40, 8, 32, 16, seed=3)
    weights, ids = route_topk(logits.float(), 2, True)
    got = fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _oracle(x, w13, w2, logits.float(), 2, True),
                               rtol=0, atol=1e-5)


def test_routing_weights_order_and_ties() -> None:
    logits = torch.tensor([[0.0, 0.0, 1.0, -1.0], [2.0, 0.5, 0.5, 0.5]])
    weights, ids = route_topk(logits, 2, False)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    probs = torch.softmax(logits, -1)
    # ties are broken exactly as torch.topk breaks them on the same float32 probabilities
    assert torch.equal(ids, torch.topk(probs, 2).indices)
    torch.testing.assert_close(weights, probs.gather(1, ids), rtol=0, atol=0)
    renormed, _ = route_topk(logits, 2, True, torch.float16)
    assert renormed.dtype == torch.float16
    torch.testing.assert_close(renormed.float().sum(-1), torch.ones(2), rtol=0, atol=1e-3)


def test_sort_by_expert_groups_tokens_stably() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 3]])
    order, counts = sort_by_expert(ids, 5)
    assert counts.tolist() == [3, 2, 2, 1, 0]
    assert order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]   # flat t * k + slot, expert by expert


def test_grouped_experts_calls_each_expert_once_on_its_tokens() -> None:
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    ids = torch.tensor([[1, 0], [1, 2], [0, 1], [2, 0]])
    weights = torch.full((4, 2), 0.5, dtype=torch.float64)
    calls: list[tuple[int, int]] = []

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        calls.append((e, xe.shape[0]))
        return xe * (e + 1)
    out = grouped_experts(x, weights, ids, 4, expert)
    assert calls == [(0, 3), (1, 3), (2, 2)]
    scale = torch.tensor([1.5, 2.5, 1.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(out, x * scale[:, None], rtol=0, atol=0)


def test_bad_arguments_say_what_is_allowed() -> None:
    x, w13, w2, logits = _problem(3, 4, 8, 4)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\].*got 5"):
        route_topk(logits, 5, True)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\), got \[0, 4\]"):
        sort_by_expert(torch.tensor([[0, 4]]), 4)
    weights, ids = route_topk(logits, 2, True)
    with pytest.raises(ValueError, match="must agree"):
        fused_experts(x, w13, w2[:, :, :3], weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_experts(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="activation must be one of silu, got 'relu'"):
        gated(torch.zeros(2, 4), "relu")
