"""The fused CPU step with LoRA slots (decoder.h's per-row adapter updates) against the
model's torch path (nybble.kernels.lora): the same hidden states and KV writes for a prefill
and a decode step whose rows use different slots or none; a bad slot raises."""
from __future__ import annotations

import pytest
import torch

from nybble.config import DEFAULT_MODEL
from nybble.models.cpu_fused import FusedCpuDecode
from tests.models.test_cpu_fused import _decode_meta, _prefill_args, _setup


def _lora_model():
    model, caches = _setup(DEFAULT_MODEL)
    slots = model.enable_lora(max_loras=3, max_rank=8)
    g = torch.Generator().manual_seed(0)
    for layer in slots.stacks:
        for a, b in layer.values():
            a[:2].copy_(torch.randn(a[:2].shape, generator=g) * 0.2)
            b[:2].copy_(torch.randn(b[:2].shape, generator=g) * 0.2)
            a[0, 4:].zero_()               # slot 0: an adapter of half the rank
    return model, caches


def _run(model, caches, fused: FusedCpuDecode | None, args, token_slots):
    model.fused_decode = fused
    model.lora.set_step(token_slots)
    with torch.no_grad():
        return model(args[0], args[1], caches, args[2])


def test_fused_lora_steps_equal_the_torch_path() -> None:
    model, caches = _lora_model()
    fused, why = FusedCpuDecode.build(model, caches)
    assert fused is not None and fused.lora is model.lora, why
    torch_caches = [c.clone() for c in caches]
    prefill = _prefill_args()
    rows = torch.tensor([0] * 5 + [-1] * 9 + [1] * 2)        # sequence -> slot 0, base, 1
    got = _run(model, caches, fused, prefill, rows)
    want = _run(model, torch_caches, None, prefill, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = _run(model, [c.clone() for c in torch_caches], None, prefill, None)
    assert not torch.allclose(got[:5], base[:5], atol=1e-2)       # slot 0 changed its rows
    torch.testing.assert_close(got[5:14], base[5:14], rtol=1e-5, atol=1e-4)   # base rows
    decode = _decode_meta()
    got = _run(model, caches, fused, decode, torch.tensor([1, 0, -1]))
    want = _run(model, torch_caches, None, decode, torch.tensor([1, 0, -1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for c, t in zip(caches, torch_caches):
        torch.testing.assert_close(c, t, rtol=1e-5, atol=1e-5)


def test_a_slot_out_of_range_is_refused_before_anything_runs() -> None:
    model, caches = _lora_model()
    fused, _ = FusedCpuDecode.build(model, caches)
    ids, pos, meta = _decode_meta()
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match=r"LoRA slots in \[-1, 3\)"):
        _run(model, caches, fused, (ids, pos, meta), torch.tensor([0, 3, -1]))
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
