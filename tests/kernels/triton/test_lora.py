"""The Triton multi-LoRA kernels (shrink, expand) against the float64 row-by-row definition,
under the Triton interpreter on CPU (natively on CUDA)."""
from __future__ import annotations

import pytest
import torch

from nybble.kernels.lora import add_lora_reference
from nybble.kernels.triton.lora import add_lora

pytestmark = [pytest.mark.triton_interpret]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,slots,rank,width,out", [(5, 3, 16, 72, 40), (1, 1, 8, 64, 64),
                                                       (9, 2, 48, 33, 130)])
def test_matches_the_float64_definition(device, dtype, rows, slots, rank, width, out) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=g)
    y = torch.randn(rows, out, generator=g)
    a = torch.randn(slots, rank, width, generator=g) * 0.3
    b_t = torch.randn(slots, rank, out, generator=g) * 0.3   # stored as LoRASlots stores it
    a[0, rank // 2:], b_t[0, rank // 2:] = 0, 0                # slot 0: half the rank
    token_slots = torch.randint(-1, slots, (rows,), generator=g)
    token_slots[0] = -1
    want = add_lora_reference(y.double().clone(), x.double(), a.double(),
                              b_t.transpose(1, 2).double(), token_slots)
    yd = y.to(device, dtype)
    got = add_lora(yd, x.to(device, dtype), a.to(device, dtype),
                   b_t.to(device, dtype).transpose(1, 2), token_slots.to(device))
    assert got is yd
    tol = TOL[dtype] * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=tol)
    base = token_slots < 0
    assert torch.equal(got.cpu()[base], y.to(dtype)[base])    # base rows untouched
