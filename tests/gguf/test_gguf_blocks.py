"""Every GGUF block type's unpacking into nybble's integers is bit-exact against gguf-py's
``gguf.quants.dequantize`` (the independent decoder), on the fixtures' real tensors and, for
Q5_1 (no fixture holds it), on a tensor gguf-py itself quantizes."""
from __future__ import annotations

import glob
import os

import gguf
import numpy as np
import pytest
import torch

from nybble.kernels.reference.quant import IntWeight, dequantize_int_weight
from nybble.quant.gguf_blocks import SUPPORTED_QUANT_TYPES, unpack_blocks
from nybble.quant.gguf_linear import GGUFQuantLinear
from nybble.quant.linear import CpuPathLog
from tests.conftest import shared_path

BASE = shared_path("fixtures", "gguf")
_KINDS = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q4_K": (4, 32, True),
          "Q5_0": (8, 32, False), "Q5_1": (8, 32, True), "Q5_K": (8, 32, True),
          "Q6_K": (8, 16, False), "Q8_0": (8, 32, False)}


def _fixture_tensors() -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType, int]]:
    """One real tensor of each quantized type (the largest: every block pattern appears)."""
    found: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType, int]] = {}
    for path in sorted(glob.glob(os.path.join(BASE, "*.gguf"))):
        for t in gguf.GGUFReader(path).tensors:
            name = t.tensor_type.name
            if name in SUPPORTED_QUANT_TYPES and (name not in found
                                                  or t.data.size > found[name][0].size):
                found[name] = (np.array(t.data), t.tensor_type, int(t.shape[0]))
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 2, (64, 1))).astype(np.float32)
    q51 = gguf.GGMLQuantizationType.Q5_1
    found["Q5_1"] = (gguf.quants.quantize(w, q51), q51, 256)
    return found


TENSORS = _fixture_tensors()


def test_every_supported_type_is_covered() -> None:
    assert sorted(TENSORS) == sorted(SUPPORTED_QUANT_TYPES)


@pytest.mark.parametrize("type_name", SUPPORTED_QUANT_TYPES)
def test_unpacking_is_bit_exact(type_name: str) -> None:
    raw, qtype, k = TENSORS[type_name]
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    ints = unpack_blocks(type_name, torch.from_numpy(raw), k)
    bits, gs, has_mins = _KINDS[type_name]
    assert (ints.bits, ints.group_size, ints.mins is not None) == (bits, gs, has_mins)
    assert int(ints.q.min()) >= 0 and int(ints.q.max()) < 2 ** bits
    g = ints.scales.shape[1]
    iw = IntWeight(ints.q.t(), torch.full((g, ints.q.shape[0]), ints.zero, dtype=torch.int32),
                   None, gs, bits, None if ints.mins is None else ints.mins.t())
    got = dequantize_int_weight(iw, ints.scales.t())
    assert torch.equal(got, expected)
    # the packed module stores the same integers (GPTQ layout + float32 scales/minimums)
    m = GGUFQuantLinear(k, ints.q.shape[0], torch.float32, torch.device("cpu"), type_name, bits,
                        gs, has_mins, CpuPathLog())
    m.load_ints(ints)
    assert torch.equal(m.dequantized_weight(), expected)
    rows = torch.tensor([3, 0, ints.q.shape[0] - 1, 3])
    assert torch.equal(m.embed_rows(rows), expected[rows])


def test_wrong_row_length_is_refused() -> None:
    raw, _, k = TENSORS["Q4_0"]
    with pytest.raises(ValueError, match="Q4_0 rows of 128 features must be 72 bytes"):
        unpack_blocks("Q4_0", torch.from_numpy(raw), 128)
    with pytest.raises(ValueError, match="GGUF type must be one of"):
        unpack_blocks("IQ2_XXS", torch.from_numpy(raw), k)
