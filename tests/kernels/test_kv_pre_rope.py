"""Keys cached before RoPE (:class:`nybble.kernels.kv_quant.RotaryKeys`): the rotation the
kernels apply as they read, its inverse (the calibration's), and the torch reference and Cython
decode kernel against a float64 oracle.

The oracle builds the float64 cache the quantized one stands for, with every key rotated by
its own position (written out here as the rotate-half formula of RoFormer, Su et al. 2021,
``k_lo = x_lo c - x_hi s``, ``k_hi = x_hi c + x_lo s``), and runs the float64 reference
attention on it; the kernels' only allowed error is their float32 arithmetic.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import RotaryKeys
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.layers import RotaryEmbedding
from tests.kernels.test_kv_quant import QDTYPES, quantized_batch, represented
from tests.kernels.triton.test_attention import oracle, rel_err


class _Config:
    rope_theta = 10000.0
    rope_scaling = None
    partial_rotary_factor = 1.0


def rotary_table(head_dim: int, positions: int, theta: float = 10000.0) -> torch.Tensor:
    """``[P, 2, D]`` float32 cos/sin rows in the full-width form, from the frequencies
    ``theta ** (-2i / D)`` written out here."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    return torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1).float()


def rotate64(x: torch.Tensor, cos_sin: torch.Tensor, position: int) -> torch.Tensor:
    """float64 rotate-half RoPE of ``x [..., D]`` at ``position``."""
    half = x.shape[-1] // 2
    c = cos_sin[position, 0, :half].double()
    s = cos_sin[position, 1, half:].double()
    lo, hi = x[..., :half].double(), x[..., half:].double()
    return torch.cat([lo * c - hi * s, hi * c + lo * s], -1)


def rotated_cache(cache64: torch.Tensor, zero: torch.Tensor, cos_sin: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
    """The float64 cache attention must see: every sequence's key ``j`` shifted by ``zero``
    and rotated by position ``j``; values as they are."""
    out = cache64.clone()
    block_size = cache64.shape[2]
    for b, length in enumerate(meta.seq_lens.tolist()):
        for j in range(length):
            blk = int(meta.block_tables[b, j // block_size])
            x = cache64[0, blk, j % block_size] + zero.double()
            out[0, blk, j % block_size] = rotate64(x, cos_sin, j)
    return out


def test_rotate_is_rope_at_each_position() -> None:
    """``RotaryKeys.rotate`` = the model's own RoPE of ``x + zero`` at each position, and the
    formula written here."""
    g = torch.Generator().manual_seed(0)
    d, hkv = 16, 3
    rope = RotaryEmbedding(_Config(), d, 64, torch.device("cpu"))
    table = rotary_table(d, 64)
    assert torch.allclose(rope.cos_sin, table, atol=1e-6)
    zero = torch.randn(hkv, d, generator=g)
    keys = torch.randn(7, hkv, d, generator=g)
    positions = torch.tensor([0, 1, 5, 17, 33, 62, 63])
    got = RotaryKeys(zero, rope.cos_sin).rotate(keys, positions)
    cos, sin = rope.lookup(positions, torch.float32)
    assert torch.allclose(got, rope.apply(keys + zero, cos, sin), atol=1e-6)
    want = torch.stack([rotate64(keys[i] + zero, table, p)
                        for i, p in enumerate(positions.tolist())])
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert not torch.allclose(got, keys + zero, atol=1e-2)   # it really rotates


def test_unapply_inverts_apply() -> None:
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(_Config(), 8, 128, torch.device("cpu"))
    x = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    cos, sin = rope.lookup(torch.randint(0, 128, (9,), generator=g), torch.float64)
    assert torch.allclose(rope.unapply(rope.apply(x, cos, sin), cos, sin), x, atol=1e-12)

    class Partial(_Config):
        partial_rotary_factor = 0.5

    partial = RotaryEmbedding(Partial(), 8, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="full-width"):
        partial.unapply(x, *partial.lookup(torch.zeros(9, dtype=torch.long), torch.float64))


REF_CASES = [
    # (block_size, Hq, Hkv, D, [(cached prefix, new tokens)])
    (16, 4, 2, 8, [(0, 1), (15, 1), (40, 1)]),          # decode only
    (16, 8, 2, 16, [(0, 17), (33, 15), (5, 1)]),         # prefill, chunked, and a decode row
    (8, 6, 3, 64, [(20, 1), (3, 9)]),
]


def _rotary_batch(seqs, block_size, hq, hkv, d, qdtype, seed=0):
    torch.manual_seed(seed)
    query, cache, kv_scale, meta = quantized_batch(seqs, block_size, hq, hkv, d, qdtype,
                                                   torch.device("cpu"))
    zero = torch.randn(hkv, d) * 0.5
    keys = RotaryKeys(zero, rotary_table(d, meta.max_seq_len + 3))
    want = oracle(query, rotated_cache(represented(cache, kv_scale), zero, keys.cos_sin, meta),
                  meta, d ** -0.5)
    return query, cache, kv_scale, meta, keys, want


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size,hq,hkv,d,seqs", REF_CASES)
def test_reference_attention_rotates_pre_rope_keys(qdtype, block_size, hq, hkv, d, seqs):
    query, cache, kv_scale, meta, keys, want = _rotary_batch(seqs, block_size, hq, hkv, d,
                                                             qdtype)
    backend = TorchAttentionBackend()
    out = backend.forward(query, cache, meta, d ** -0.5, kv_scale, rotary_keys=keys)
    assert out.dtype == torch.float32
    assert rel_err(out, want) < 1e-5
    meta.plan = None
    unrotated = backend.forward(query, cache, meta, d ** -0.5, kv_scale)
    assert rel_err(unrotated, want) > 1e-2      # the rotation matters to the answer


def test_rotary_keys_need_a_quantized_cache() -> None:
    query, cache, kv_scale, meta, keys, _ = _rotary_batch([(3, 1)], 16, 2, 2, 8, torch.int8)
    with pytest.raises(ValueError, match="rotary_keys needs a quantized"):
        TorchAttentionBackend().forward(query, cache.float(), meta, 0.3, kv_scale,
                                        rotary_keys=keys)


def _cpu_backend():
    from nybble.kernels.cpu.backend import CpuAttentionBackend, cpu_kernel_available

    if not cpu_kernel_available():
        pytest.skip("the CPU kernel extension is not built")
    return CpuAttentionBackend()


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size,hq,hkv,d", [(16, 4, 2, 8), (8, 6, 3, 64), (16, 8, 1, 20),
                                                  (4, 4, 4, 128)])
def test_cpu_decode_kernel_rotates_pre_rope_keys(qdtype, block_size, hq, hkv, d):
    """The Cython decode kernel with ``key_zero``/``cos_sin`` against the oracle, also with a
    sliding window and a soft cap."""
    backend = _cpu_backend()
    seqs = [(0, 1), (6, 1), (block_size, 1), (3 * block_size + 4, 1)]
    query, cache, kv_scale, meta, keys, want = _rotary_batch(seqs, block_size, hq, hkv, d,
                                                             qdtype)
    assert backend._uses_kernel(meta, cache)
    out = backend.forward(query, cache, meta, d ** -0.5, kv_scale, rotary_keys=keys)
    assert rel_err(out, want) < 1e-5
    rot64 = rotated_cache(represented(cache, kv_scale), keys.zero, keys.cos_sin, meta)
    for extra in ({"window": 5}, {"softcap": 2.0}):
        got = backend.forward(query, cache, meta, d ** -0.5, kv_scale, rotary_keys=keys, **extra)
        assert rel_err(got, oracle(query, rot64, meta, d ** -0.5, **extra)) < 1e-5, extra


def test_cpu_decode_kernel_checks_its_rotary_arguments() -> None:
    _cpu_backend()
    from nybble.kernels.cpu.attention import paged_decode_attention

    cache = np.zeros((2, 2, 16, 2, 8), np.int8)
    base = (np.zeros((1, 2, 8), np.float32), cache, np.zeros((1, 2), np.int32),
            np.full(1, 5, np.int32), 0.3, np.zeros((1, 2, 8), np.float32),
            np.zeros(256, np.float32), np.ones((2, 2), np.float32))
    zero, table = np.zeros((2, 8), np.float32), rotary_table(8, 5).numpy()
    with pytest.raises(ValueError, match="go together"):
        paged_decode_attention(*base, cos_sin=table)
    with pytest.raises(ValueError, match=r"cos_sin must be \[P >= 5, 2, D=8\]"):
        paged_decode_attention(*base, key_zero=zero, cos_sin=table[:4])
    with pytest.raises(ValueError, match=r"key_zero must be \[2, 8\]"):
        paged_decode_attention(*base, key_zero=zero[:1], cos_sin=table)
    with pytest.raises(ValueError, match="need a quantized"):
        paged_decode_attention(base[0], cache.astype(np.float32), *base[2:7],
                               key_zero=zero, cos_sin=table)
    with pytest.raises(ValueError, match="scratch must hold"):
        paged_decode_attention(*base[:6], np.zeros(2 * (5 + 8 + 1), np.float32), base[7],
                               key_zero=zero, cos_sin=table)
    paged_decode_attention(*base[:6], np.zeros(2 * (5 + 8 + 1) + 3 * 8, np.float32), base[7],
                           key_zero=zero, cos_sin=table)
