"""The Triton fused-MoE grouped GEMM against the torch reference
(:func:`nybble.kernels.reference.moe.fused_experts`, itself checked against a float64
per-token oracle) on small shapes: natively on CUDA, else under ``TRITON_INTERPRET=1``."""
from __future__ import annotations

import pytest
import torch

from nybble.kernels.reference import moe as reference
from nybble.kernels.triton.fused_moe import align_blocks, fused_experts

pytestmark = [pytest.mark.triton_interpret]

TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _problem(tokens: int, experts: int, hidden: int,  # type: ignore[no-untyped-def]
             inter: int, top_k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g) * 2
    weights, ids = reference.route_topk(logits, top_k, True)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype),
            weights.to(device), ids.to(device))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (5, 8, 2), (19, 4, 1),
                                                  (70, 2, 2)])
def test_equals_the_torch_reference_float32(device, tokens, experts, top_k) -> None:
    x, w13, w2, weights, ids = _problem(tokens, experts, 32, 16, top_k, torch.float32, device)
    got = fused_experts(x, w13, w2, weights, ids)
    want = reference.fused_experts(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_close_to_float32(device, dtype) -> None:
    x, w13, w2, weights, ids = _problem(9, 4, 32, 16, 2, dtype, device, seed=1)
    got = fused_experts(x, w13, w2, weights, ids)
    want = reference.fused_experts(x.cpu().float(), w13.cpu().float(), w2.cpu().float(),
                                   weights.cpu(), ids.cpu())
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want, rtol=0, atol=TOL[dtype])


def test_experts_without_tokens_and_padding_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    pairs, block_expert = align_blocks(ids, 5, 4)
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 3: pairs 0, 2, 5; each run padded to 4
    assert block_expert.tolist() == [0, 1, 3, -1, -1, -1, -1]
    assert pairs[:12].tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert (pairs[12:] == 6).all()


def test_bad_shapes_say_what_must_agree(device) -> None:
    x, w13, w2, weights, ids = _problem(3, 4, 32, 16, 2, torch.float32, device)
    with pytest.raises(ValueError, match="must agree"):
        fused_experts(x, w13, w2[:, :16], weights, ids)
    with pytest.raises(ValueError, match=r"must both be \[3, top_k\]"):
        fused_experts(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="must have x's dtype"):
        fused_experts(x, w13.half(), w2, weights, ids)
