"""Batched LoRA (nybble.kernels.lora) against the definition computed in float64."""
from __future__ import annotations

import pytest
import torch
from nybble.kernels.lora import (
    LoRARows,
    add_lora,
    add_lora_gathered,
    add_lora_reference,
    add_lora_stacked,
)


def _case(rows: int, slots: int, rank: int, width: int, out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    y = torch.randn(rows, out, generator=g)
    a = torch.randn(slots, rank, width, generator=g)
    b = torch.randn(slots, out, rank, generator=g)
    a[0, rank // 2:] = 0            # slot 0 holds an adapter of half the rank (zero-padded)
    b[0, :, rank // 2:] = 0
    token_slots = torch.randint(-1, slots, (rows,), generator=g)
    token_slots[0] = -1             # at least one base row
    return y, x, a, b, token_slots


def _prepared(impl, token_slots: torch.Tensor, slots: int):
    """``impl`` with its rows argument prepared for its path."""
    if impl is add_lora:
        return lambda y, x, a, b: add_lora(y, x, a, b, token_slots)
    rows = LoRARows.of(token_slots, slots, torch.float32, gathered=impl is add_lora_gathered)
    return lambda y, x, a, b: impl(y, x, a, b, rows)


@pytest.mark.parametrize("impl", [add_lora_gathered, add_lora_stacked, add_lora])
@pytest.mark.parametrize("rows,slots", [(1, 1), (3, 4), (40, 3), (7, 2)])
def test_matches_the_float64_definition(impl, rows: int, slots: int) -> None:
    y, x, a, b, token_slots = _case(rows, slots, 8, 24, 20, seed=rows + slots)
    expected = add_lora_reference(y.double().clone(), x.double(), a.double(), b.double(),
                                  token_slots)
    got = _prepared(impl, token_slots, slots)(y.clone(), x, a, b)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("impl", [add_lora_gathered, add_lora_stacked])
def test_base_rows_are_left_bit_for_bit(impl) -> None:
    y, x, a, b, _ = _case(9, 3, 4, 16, 12)
    token_slots = torch.tensor([-1, 0, -1, 2, -1, 1, -1, -1, 0])
    got = _prepared(impl, token_slots, 3)(y.clone(), x, a, b)
    base = token_slots < 0
    assert torch.equal(got[base], y[base])
    assert not torch.allclose(got[~base], y[~base])


def test_updates_in_place_and_returns_y_and_prepared_rows_give_the_same() -> None:
    y, x, a, b, token_slots = _case(5, 2, 4, 8, 6)
    expected = add_lora(y.clone(), x, a, b, token_slots)
    assert add_lora(y, x, a, b, LoRARows.of(token_slots, 2, torch.float32)) is y
    assert torch.equal(y, expected)


def test_the_path_follows_the_size() -> None:
    slots = torch.zeros(3, dtype=torch.int64)
    assert LoRARows.of(slots, 2, torch.float32).gathered
    assert not LoRARows.of(torch.zeros(40, dtype=torch.int64), 2, torch.float32).gathered


def test_mismatched_shapes_are_refused() -> None:
    y, x, a, b, token_slots = _case(5, 2, 4, 8, 6)
    with pytest.raises(ValueError, match="lora_a must be"):
        add_lora(y, x, a, b.transpose(1, 2), token_slots)
    with pytest.raises(ValueError, match="token_slots"):
        add_lora(y, x, a, b, token_slots[:3])
