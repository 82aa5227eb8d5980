"""Pack/unpack round trips and the worked examples of docs/quant-formats.md §3.7 / §4.4."""
from __future__ import annotations

import pytest
import torch

from nybble.kernels.packing import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    pack_cols,
    pack_rows,
    unpack_cols,
    unpack_rows,
)
from nybble.kernels.reference.quant import dequantize_awq, dequantize_gptq


def _i32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


# q[k, n] = (k + 2n) mod 16, 8x8 (spec §3.7)
Q8 = torch.tensor([[(k + 2 * n) % 16 for n in range(8)] for k in range(8)])
SCALES = torch.tensor([[(n + 1) / 16 for n in range(8)]], dtype=torch.float16)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("order", [None, "awq"])
def test_round_trips(bits: int, order: str | None) -> None:
    g = torch.Generator().manual_seed(bits)
    pf = 32 // bits
    ordr = AWQ_ORDER if (order == "awq" and pf == 8) else None
    v = torch.randint(0, 1 << bits, (3 * pf, 5 * pf), generator=g)
    assert torch.equal(unpack_rows(pack_rows(v, bits), bits).long(), v)
    assert torch.equal(unpack_cols(pack_cols(v, bits, ordr), bits, ordr).long(), v)
    words = torch.randint(-2**31, 2**31 - 1, (4, 6), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(pack_rows(unpack_rows(words, bits), bits), words)
    assert torch.equal(pack_cols(unpack_cols(words, bits, ordr), bits, ordr), words)


def test_pack_rejects_out_of_range_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="values must be in"):
        pack_rows(torch.full((8, 1), 16), 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_cols(torch.zeros(1, 7, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="bits must be"):
        pack_rows(torch.zeros(8, 1, dtype=torch.int64), 3)


def test_gptq_worked_example_qweight() -> None:
    expected = [0x76543210, 0x98765432, 0xBA987654, 0xDCBA9876, 0xFEDCBA98, 0x10FEDCBA,
                0x3210FEDC, 0x543210FE]
    qw = pack_rows(Q8, 4)
    assert qw.tolist() == [[_i32(w) for w in expected]]
    assert qw[0, 1].item() == -1737075662 and qw[0, 4].item() == -19088744


def test_gptq_worked_example_sym_and_asym() -> None:
    qw = pack_rows(Q8, 4)
    v1 = torch.tensor([[_i32(0x77777777)]], dtype=torch.int32)
    v2 = torch.tensor([[_i32(0x88888888)]], dtype=torch.int32)
    for qz, off in ((v1, 1), (v2, 0)):
        w = dequantize_gptq(qw, qz, SCALES, None, 4, 8, off, sym=False)
        assert w[0, 0].item() == -0.5 and w[1, 0].item() == -0.75 and w[7, 1].item() == 3.5
    z = torch.arange(1, 9).view(1, 8)
    assert pack_cols(z - 1, 4).tolist() == [[0x76543210]]
    assert pack_cols(z, 4).tolist() == [[_i32(0x87654321)]]
    w = dequantize_gptq(qw, pack_cols(z - 1, 4), SCALES, None, 4, 8, 1, sym=False)
    ref = (Q8.t() - z.t()).double() * SCALES.t().double()
    assert torch.equal(w.double(), ref)
    z32 = torch.tensor([list(range(9, 16)) + [1]])
    assert pack_cols(z32 - 1, 4).tolist() == [[0x0EDCBA98]]


def test_gptq_worked_example_8bit() -> None:
    q = torch.tensor([[k + 2 * n for n in range(8)] for k in range(8)])
    qw = pack_rows(q, 8)
    assert qw.shape == (2, 8)
    assert qw[0, 0].item() == 0x03020100 and qw[0, 1].item() == 0x05040302
    assert qw[1, 0].item() == 0x07060504
    assert pack_cols(torch.full((1, 4), 127), 8).item() == 0x7F7F7F7F
    assert pack_cols(torch.full((1, 4), 128), 8).item() == _i32(0x80808080)


def test_awq_worked_example() -> None:
    expected = [0xEA62C840, 0xFB73D951, 0x0C84EA62, 0x1D95FB73, 0x2EA60C84, 0x3FB71D95,
                0x40C82EA6, 0x51D93FB7]
    qw = pack_cols(Q8, 4, AWQ_ORDER)
    assert qw.view(-1).tolist() == [_i32(w) for w in expected]
    qz = pack_cols(torch.arange(8).view(1, 8), 4, AWQ_ORDER)
    assert qz.tolist() == [[0x75316420]]
    w = dequantize_awq(qw, qz, SCALES, 8)
    assert w[1, 0].item() == 0.125
    assert [AWQ_ORDER.index(j) for j in range(8)] == list(AWQ_REVERSE_ORDER)


def test_dequant_gptq_equals_spec_formula_on_random_words() -> None:
    """§3.5 evaluated element by element with Python ints (independent of the vectorised code)."""
    g = torch.Generator().manual_seed(11)
    for bits, v2 in ((4, False), (4, True), (8, False)):
        pf, mask = 32 // bits, (1 << bits) - 1
        k, n, gs = 2 * pf * 2, 2 * pf, pf
        qw = torch.randint(-2**31, 2**31 - 1, (k // pf, n), generator=g).to(torch.int32)
        qz = torch.randint(-2**31, 2**31 - 1, (k // gs, n // pf), generator=g).to(torch.int32)
        sc = (torch.rand(k // gs, n, generator=g) + 0.1).half()
        gi = torch.randint(0, k // gs, (k,), generator=g).to(torch.int32)
        w = dequantize_gptq(qw, qz, sc, gi, bits, gs, 0 if v2 else 1, sym=False)
        for kk in range(k):
            for nn_ in range(n):
                grp = int(gi[kk])
                q = ((int(qw[kk // pf, nn_]) & 0xFFFFFFFF) >> (bits * (kk % pf))) & mask
                f = ((int(qz[grp, nn_ // pf]) & 0xFFFFFFFF) >> (bits * (nn_ % pf))) & mask
                z = f if v2 else (f + 1) & mask
                exp = torch.tensor(float(sc[grp, nn_]) * (q - z), dtype=torch.float32).half()
                assert w[nn_, kk] == exp
