"""The fused step's dense float32 projection loop called on its own (``dense_linear``), which
runs a float32 LM head of a few rows on the CPU: against float64 products, on the AVX2 copy
and the portable one, for every row count (the 4-row register tiles and the 1-3 row loop
that prefetches) and odd output counts; and the model's ``compute_logits`` uses it where it
applies and torch elsewhere, with the same logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.kernels.cpu.decoder import dense_linear
from nybble.models.cpu_fused import DENSE_HEAD_MIN_BYTES, DENSE_HEAD_ROWS, dense_head


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n", [1, 7, 4099])
@pytest.mark.parametrize("portable", [False, True])
def test_dense_linear_equals_float64_products(rows: int, n: int, portable: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(n, 576, generator=g)
    out = np.full((rows, n), np.nan, np.float32)
    dense_linear(x.numpy(), w.numpy(), out, portable)
    want = x.double() @ w.double().T
    # float32 sums of 576 products of unit normals: well inside 1e-4 of the exact sum
    torch.testing.assert_close(torch.from_numpy(out).double(), want, rtol=0, atol=1e-4)


def test_dense_linear_checks_shapes() -> None:
    x, w = np.zeros((2, 8), np.float32), np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match=r"x \[T, K\], w \[N, K\] and out \[T, N\]"):
        dense_linear(x, w, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError):
        dense_linear(x, np.zeros((5, 7), np.float32), np.zeros((2, 5), np.float32))


def test_dense_head_takes_few_float32_cpu_rows_of_a_large_head_only() -> None:
    w = torch.randn(DENSE_HEAD_MIN_BYTES // 4 // 64 + 3, 64)
    for rows in range(1, DENSE_HEAD_ROWS):
        h = torch.randn(rows, 64)
        got = dense_head(h, w)
        assert got is not None and got.dtype == torch.float32 and got.shape == (rows, len(w))
        torch.testing.assert_close(got, torch.nn.functional.linear(h, w), rtol=1e-5,
                                   atol=1e-5)
    assert dense_head(torch.randn(DENSE_HEAD_ROWS, 64), w) is None
    assert dense_head(torch.randn(1, 64, dtype=torch.float64), w.double()) is None
    assert dense_head(torch.randn(1, 64), w.t().contiguous().t()) is None  # not row-major
    assert dense_head(torch.randn(1, 64), w[:100]) is None   # a head that stays in the caches
