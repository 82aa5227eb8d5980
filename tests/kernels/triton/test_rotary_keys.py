"""Triton paged attention over a quantized cache that holds keys before RoPE
(:class:`nybble.kernels.kv_quant.RotaryKeys`), against a float64 oracle written here.

Oracle: the cache bytes decoded in float64 (``float64(q) * kv_scale``), the keys of every
sequence rotated by :meth:`RotaryKeys.rotate` in float64 at their token positions, then a
direct masked (causal, sliding-window) softmax attention per sequence, soft-capped where
asked. The rotary table is a real one (:class:`nybble.models.layers.RotaryEmbedding`) and
covers exactly the longest sequence, so a padded key row that read its table row unmasked
would read past it. Output buffers are poisoned with NaN so an unwritten element fails.
"""
from __future__ import annotations

import types

import pytest
import torch

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import RotaryKeys
from nybble.kernels.triton.backend import TritonAttentionBackend
from nybble.kernels.triton.paged_decode import paged_decode_attention
from nybble.kernels.triton.paged_prefill import paged_prefill_attention
from nybble.models.layers import RotaryEmbedding
from tests.kernels.test_kv_quant import quantized_batch, represented
from tests.kernels.triton.test_attention import make_batch, rel_err

pytestmark = [pytest.mark.triton_interpret]

QDTYPES = [torch.int8, torch.float8_e4m3fn]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def rotary_table(head_dim: int, num_pos: int) -> torch.Tensor:
    """``[num_pos, 2, head_dim]`` float32, the model's own full-width table (``cos = [c, c]``,
    ``sin = [-s, s]``); theta 100 so that even the slow channels turn over a short sequence."""
    rope = RotaryEmbedding(types.SimpleNamespace(rope_theta=100.0), head_dim, num_pos,
                           torch.device("cpu"))
    return rope.cos_sin.float()


def rotary_batch(seqs, block_size, hq, hkv, d, qdtype, device, query_dtype=torch.float32,
                 num_pos=None):
    """A random quantized paged batch and its :class:`RotaryKeys`: a random per-channel
    ``zero`` of the keys' own size, and a table of ``num_pos`` rows (default: exactly the
    longest sequence)."""
    query, cache, kv_scale, meta = quantized_batch(seqs, block_size, hq, hkv, d, qdtype, device,
                                                   query_dtype)
    zero = (torch.randn(hkv, d) * 2.0).to(device)
    table = rotary_table(d, num_pos or meta.max_seq_len).to(device)
    return query, cache, kv_scale, meta, RotaryKeys(zero, table)


def oracle(query: torch.Tensor, cache: torch.Tensor, kv_scale: torch.Tensor,
           meta: AttentionMetadata, scale: float, rotary_keys: RotaryKeys | None,
           window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """float64 ``[T, Hq, D]`` on CPU: each new token over its sequence's keys (rotated by
    ``rotary_keys`` at their positions when given), causal, within ``window`` if set."""
    kv = represented(cache, kv_scale)  # [2, NB, BS, Hkv, D] float64
    _, _, block_size, hkv, d = kv.shape
    kv = kv.reshape(2, -1, hkv, d)
    rot = None
    if rotary_keys is not None:
        rot = RotaryKeys(rotary_keys.zero.cpu().double(), rotary_keys.cos_sin.cpu().double())
    q = query.cpu().double()
    group = q.shape[1] // hkv
    qsl, lens, tables = (meta.query_start_loc.cpu().tolist(), meta.seq_lens.cpu().tolist(),
                         meta.block_tables.cpu().long())
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(lens):
        pos = torch.arange(seq_len)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        keys, values = kv[0, slots], kv[1, slots]  # [S, Hkv, D]
        if rot is not None:
            keys = rot.rotate(keys, pos)
        keys = keys.repeat_interleave(group, 1)
        values = values.repeat_interleave(group, 1)
        q_len = qsl[b + 1] - qsl[b]
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores = torch.einsum("thd,shd->hts", q[qsl[b]:qsl[b + 1]], keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        visible = pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
    return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output"
    err = rel_err(out.cpu(), ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


def run(query, cache, kv_scale, meta, scale, rotary_keys, partition_size=None, **kwargs):
    """Decode kernel for a decode-only batch, else the varlen kernel, into a NaN buffer."""
    out = torch.full_like(query, float("nan"))
    if meta.is_decode_only:
        return paged_decode_attention(query, cache, meta, scale, out=out, kv_scale=kv_scale,
                                      partition_size=partition_size, rotary_keys=rotary_keys,
                                      **kwargs)
    return paged_prefill_attention(query, cache, meta, scale, out=out, kv_scale=kv_scale,
                                   rotary_keys=rotary_keys, **kwargs)


CASES = [
    # (block_size, Hq, Hkv, D, query dtype, [(cached prefix, new tokens)], decode partition)
    (4, 4, 2, 8, torch.float32, [(0, 1), (6, 1), (21, 1), (40, 1)], 16),   # decode, splits
    (16, 4, 2, 16, torch.float32, [(16, 1), (35, 1), (2, 1)], None),        # decode, BS 16
    (16, 8, 4, 16, torch.float16, [(30, 1), (4, 1)], None),                 # decode, fp16
    (4, 4, 2, 8, torch.float32, [(0, 17), (20, 5), (3, 1), (9, 2)], None),  # prefill + chunk
    (16, 4, 2, 16, torch.float32, [(0, 33), (17, 16), (5, 1)], None),       # + decode row
    (16, 8, 4, 16, torch.float16, [(12, 7), (0, 9)], None),                 # fp16
]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("block_size,hq,hkv,d,qdt,seqs,partition", CASES)
def test_kernels_rotate_pre_rope_keys(qdtype, block_size, hq, hkv, d, qdt, seqs, partition,
                                      device):
    query, cache, kv_scale, meta, rk = rotary_batch(seqs, block_size, hq, hkv, d, qdtype,
                                                    device, qdt)
    scale = d ** -0.5
    out = run(query, cache, kv_scale, meta, scale, rk, partition)
    ref = oracle(query, cache, kv_scale, meta, scale, rk)
    check(out, ref, qdt)
    # the oracle tells rotations apart: keys one position off, or without their zero point,
    # miss by far more than the tolerance
    shifted = RotaryKeys(rk.zero, torch.cat((rk.cos_sin[:1], rk.cos_sin[:-1])))
    for wrong in (shifted, RotaryKeys(torch.zeros_like(rk.zero), rk.cos_sin)):
        assert rel_err(out.cpu(), oracle(query, cache, kv_scale, meta, scale, wrong)) > 0.05


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (7, 1.5)])
def test_window_and_softcap(window, softcap, device):
    """Decode (many splits, some before the window) and a mixed prefill batch, fp8."""
    scale = 8 ** -0.5
    for seqs, partition in (([(c - 1, 1) for c in (50, 1, 23, 9)], 16),
                            ([(20, 1), (0, 19), (13, 6)], None)):
        query, cache, kv_scale, meta, rk = rotary_batch(seqs, 4, 4, 2, 8,
                                                        torch.float8_e4m3fn, device)
        out = run(query, cache, kv_scale, meta, scale, rk, partition, window=window,
                  softcap=softcap)
        check(out, oracle(query, cache, kv_scale, meta, scale, rk, window, softcap),
              torch.float32)


@pytest.mark.parametrize("seqs", [[(3, 1), (26, 1)], [(0, 6), (11, 3), (29, 1)]])
def test_backend_passes_rotary_keys(seqs, device):
    """``forward`` hands ``rotary_keys`` to the decode and to the varlen kernel."""
    query, cache, kv_scale, meta, rk = rotary_batch(seqs, 16, 4, 2, 8, torch.int8, device)
    out = TritonAttentionBackend().forward(query, cache, meta, 8 ** -0.5, kv_scale,
                                           rotary_keys=rk)
    check(out, oracle(query, cache, kv_scale, meta, 8 ** -0.5, rk), torch.float32)


@pytest.mark.parametrize("seqs", [[(7, 1), (30, 1)], [(0, 6), (11, 3), (29, 1)]])
def test_identity_rotation_equals_the_plain_path(seqs, device):
    """A zero shift and the identity table (cos 1, sin 0) give bit for bit the output of
    ``rotary_keys=None``, which equals the oracle on the cache as stored: the rope path adds
    exact zeros only, and the no-rope path is untouched."""
    query, cache, kv_scale, meta, rk = rotary_batch(seqs, 4, 4, 2, 16, torch.int8, device)
    table = torch.zeros_like(rk.cos_sin)
    table[:, 0] = 1.0
    identity = RotaryKeys(torch.zeros_like(rk.zero), table)
    plain = run(query, cache, kv_scale, meta, 0.25, None, 16)
    check(plain, oracle(query, cache, kv_scale, meta, 0.25, None), torch.float32)
    assert torch.equal(run(query, cache, kv_scale, meta, 0.25, identity, 16), plain)
    assert rel_err(run(query, cache, kv_scale, meta, 0.25, rk, 16).cpu(), plain.cpu()) > 0.05


@pytest.mark.parametrize("seqs", [[(30, 1), (2, 1)], [(30, 1), (0, 12)]])
def test_short_table_clamps_like_rotate(seqs, device):
    """A table shorter than the sequences (outside the contract) reads its last row for the
    later positions, as :meth:`RotaryKeys.rotate` does, and never past it."""
    query, cache, kv_scale, meta, rk = rotary_batch(seqs, 4, 4, 2, 8, torch.int8, device,
                                                    num_pos=9)
    out = run(query, cache, kv_scale, meta, 8 ** -0.5, rk, 16)
    check(out, oracle(query, cache, kv_scale, meta, 8 ** -0.5, rk), torch.float32)


def test_rotary_keys_need_a_quantized_cache(device):
    query, cache, meta = make_batch([(5, 1)], 16, 4, 2, 8, torch.float32, device)
    rk = RotaryKeys(torch.zeros(2, 8, device=device), rotary_table(8, 8).to(device))
    for call in (paged_decode_attention, paged_prefill_attention,
                 TritonAttentionBackend().forward):
        with pytest.raises(ValueError, match="rotary_keys .* needs a quantized"):
            call(query, cache, meta, 0.3, rotary_keys=rk)


def test_rotary_keys_shapes_are_checked(device):
    query, cache, kv_scale, meta, rk = rotary_batch([(5, 1)], 16, 4, 2, 8, torch.int8, device)
    bad = [RotaryKeys(rk.zero[:1], rk.cos_sin),                  # one head short
           RotaryKeys(rk.zero, rk.cos_sin[:, :, :4]),            # half the head dim
           RotaryKeys(rk.zero, rk.cos_sin.double()),             # not float32
           RotaryKeys(rk.zero, rk.cos_sin[:0])]                  # empty table
    for wrong in bad:
        for call in (paged_decode_attention, paged_prefill_attention):
            with pytest.raises(ValueError, match="rotary_keys needs zero"):
                call(query, cache, meta, 0.3, kv_scale=kv_scale, rotary_keys=wrong)
