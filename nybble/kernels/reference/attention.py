"""Pure-torch paged attention: the CPU path of the engine and, in float64, the test oracle.

Algorithm: PagedAttention (Kwon et al., SOSP 2023), KV read through block tables; masking as
in FlashAttention-2's varlen causal mode (each sequence's new tokens are the last ``q_len`` of
its ``seq_len`` tokens). Shapes follow :mod:`nybble.kernels.interface`.

What depends only on the batch layout (which cache rows each sequence reads, the masks, where
each token sits in the padded query) is derived once per step, by the first layer, into
``meta.plan`` (:class:`AttentionPlan`); the other layers reuse it. Decode rows (one new token)
take a path of four ops: one gather of their keys/values laid out ``[B * Hkv, S, D]``, then
``softmax(q k^T * scale + mask) v`` as two batched GEMMs (the query heads of one KV head are
the rows of one GEMM: GQA without copying K/V). Prefill chunks are padded to their group's
longest chunk and run through ``scaled_dot_product_attention`` with a causal mask.

A sliding-window layer (Mistral, Gemma, ...) sees only the last ``window`` positions up to
its own (transformers' rule: key ``j`` is visible to query ``i`` iff ``i - window < j <= i``):
the step's masks restricted to the window are derived once per window size
(:func:`windowed_plan`). Soft-capping (Gemma 2: ``c * tanh(s / c)`` on the scaled scores)
computes the scores explicitly instead of through ``scaled_dot_product_attention``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import RotaryKeys, as_bytes, is_quantized_cache, quantize_kv


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Scatter new keys/values into the paged cache.

    Args:
        key, value: ``[T, Hkv, D]``, any float dtype (cast to a float cache's dtype, rounded
            to nearest even; quantized for an ``int8`` / ``float8_e4m3fn`` cache).
        kv_cache: ``[2, NB, BS, Hkv, D]``, written in place.
        slot_mapping: ``[T]`` int64 flat slot per token; ``-1`` entries are skipped.
        kv_scale: ``[2, Hkv]`` float32 per-head scales of keys and values; needed when
            ``kv_cache`` is ``int8`` / ``float8_e4m3fn`` (:mod:`nybble.kernels.kv_quant`).
    """
    write_slots(key, value, kv_cache, slot_mapping, write_rows(slot_mapping), kv_scale)


def write_rows(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """``[W]`` int64 rows whose slot is ``>= 0``, or ``None`` when every row's is (one host
    sync: done once per step)."""
    valid = slot_mapping >= 0
    return None if bool(valid.all()) else valid.nonzero().flatten()


def write_slots(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, rows: torch.Tensor | None,
                kv_scale: torch.Tensor | None = None) -> None:
    """Write tokens ``rows`` (all when None) of ``key``/``value`` to their slots, quantized
    with ``kv_scale`` when the cache is (see :func:`reshape_and_cache`)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = as_bytes(kv_cache).view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if rows is not None:
        slot_mapping, key, value = slot_mapping[rows], key[rows], value[rows]
    if is_quantized_cache(kv_cache):
        key = as_bytes(quantize_kv(key, _require(kv_scale)[0], kv_cache.dtype))
        value = as_bytes(quantize_kv(value, kv_scale[1], kv_cache.dtype))
    else:   # NOTE: a cache of another float dtype (bfloat16 for a float32 model): rounded here
        key, value = _cast(key, kv_cache.dtype), _cast(value, kv_cache.dtype)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


@dataclass(slots=True)
class DecodePlan:
    """The decode rows (one new token each) of a step, as every layer reads them.

    Attributes:
        tokens: ``[Bd]`` int64 flat token row of each decode sequence, or ``None`` when the
            step is decode-only (row ``b`` is sequence ``b``).
        kv_rows: ``[Bd * Hkv * S]`` int64 rows of the cache viewed ``[2, NB * BS * Hkv, D]``,
            ordered (sequence, KV head, position) so one ``index_select`` yields
            ``[Bd * Hkv, S, D]``; positions past a sequence's length read row 0 (masked).
        bias: ``[Bd * Hkv, 1, S]`` float32 additive mask: 0 for key positions
            ``< seq_len``, ``-inf`` past it.
        max_seq_len: ``S`` (tokens).
        seq_lens: ``[Bd]`` int64 length of each decode sequence.
    """

    tokens: torch.Tensor | None
    kv_rows: torch.Tensor
    bias: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor


@dataclass(slots=True)
class PrefillPlan:
    """The prefill chunks (more than one new token) of a step, padded to the longest.

    Attributes:
        tokens: ``[Tp]`` int64 flat token rows of the chunks, or ``None`` when every token
            of the step is in a chunk (then they are in order).
        pad_rows: ``[Tp]`` int64 row of each token in the padded ``[Bp * max_q]`` layout.
        kv_slots: ``[Bp * S]`` int64 cache slots (``[2, NB * BS, Hkv, D]`` view) each chunk
            reads; past a sequence's length they read slot 0 (masked).
        allowed: ``[Bp, 1, max_q, S]`` bool causal mask.
        batch, max_query_len, max_seq_len: ``Bp``, ``max_q``, ``S``.
        q_pos: ``[Bp, max_q]`` int64 absolute position of each (padded) query row.
        causal: every chunk starts at position 0 and nothing narrows ``allowed`` (no
            window): ``allowed`` is then the plain causal mask for every row kept, and the
            attention runs as ``is_causal`` (no mask tensor: torch's faster flash path).
    """

    tokens: torch.Tensor | None
    pad_rows: torch.Tensor
    kv_slots: torch.Tensor
    allowed: torch.Tensor
    batch: int
    max_query_len: int
    max_seq_len: int
    q_pos: torch.Tensor
    causal: bool = False


@dataclass(slots=True)
class AttentionPlan:
    """``meta.plan`` of the torch backend: one step's decode and prefill groups, and which
    tokens write the cache (``write_rows``: all when ``None``; ``-1`` slots are skipped);
    ``windowed``: the same plan with masks restricted to a sliding window, by window size
    (made on first use, :func:`windowed_plan`)."""

    decode: DecodePlan | None
    prefill: PrefillPlan | None
    write_rows: torch.Tensor | None
    windowed: dict[int, AttentionPlan] = field(default_factory=dict)


_ARANGE: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int64, a slice of one cached tensor per device (grown on demand)."""
    cached = _ARANGE.get(device)
    if cached is None or cached.shape[0] < n:
        cached = _ARANGE[device] = torch.arange(max(n, 4096), device=device)
    return cached[:n]


@functools.lru_cache(maxsize=16)
def _row_offsets(block_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """``[Hkv, 1, BS]`` int64: row ``j * Hkv + h`` of slot ``j`` of a block, KV head ``h``."""
    heads = torch.arange(num_kv_heads, device=device)[:, None, None]
    return torch.arange(block_size, device=device)[None, None, :] * num_kv_heads + heads


def _block_rows(block_tables: torch.Tensor, max_seq_len: int, block_size: int,
                rows_per_slot: int) -> torch.Tensor:
    """``[B, nb]`` int64 first row of each block holding the first ``S = max_seq_len``
    positions, in a cache view with ``rows_per_slot`` rows per slot; padding (``-1``) reads
    block 0 (the caller masks it)."""
    nb = -(-max_seq_len // block_size)
    return block_tables[:, :nb].long().clamp_(min=0).mul_(block_size * rows_per_slot)


def _slots(block_tables: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
    """``[B * S]`` int64 cache slot of each sequence's first ``S = max_seq_len`` positions."""
    base = _block_rows(block_tables, max_seq_len, block_size, 1)
    batch, nb = base.shape
    slots = (base[:, :, None] + _arange(block_size, base.device)).view(batch, nb * block_size)
    return slots[:, :max_seq_len].reshape(-1)


def _plan_decode(meta: AttentionMetadata, group: torch.Tensor | None, kv_cache: torch.Tensor
                 ) -> DecodePlan:
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    seq_lens, tables = meta.seq_lens, meta.block_tables
    tokens = None
    if group is None:
        max_seq_len = meta.max_seq_len
    else:
        seq_lens, tables = seq_lens[group], tables[group]
        tokens = meta.query_start_loc[:-1].long()[group]
        max_seq_len = int(seq_lens.max())
    base = _block_rows(tables, max_seq_len, block_size, num_kv_heads)
    batch, nb = base.shape
    rows = base.view(batch, 1, nb, 1) + _row_offsets(block_size, num_kv_heads, base.device)
    kv_rows = rows.view(batch, num_kv_heads, nb * block_size)[:, :, :max_seq_len].reshape(-1)
    masked = _arange(max_seq_len, base.device) >= seq_lens.view(batch, 1, 1, 1)
    bias = torch.where(masked, float("-inf"), 0.0).expand(batch, num_kv_heads, 1, max_seq_len)
    return DecodePlan(tokens, kv_rows, bias.reshape(-1, 1, max_seq_len), max_seq_len,
                      seq_lens.long())


def _plan_prefill(meta: AttentionMetadata, group: torch.Tensor | None, q_lens: torch.Tensor,
                  kv_cache: torch.Tensor) -> PrefillPlan:
    qsl = meta.query_start_loc.long()
    seq_lens, tables, starts = meta.seq_lens.long(), meta.block_tables, qsl[:-1]
    if group is not None:
        q_lens, seq_lens, tables, starts = q_lens[group], seq_lens[group], tables[group], \
            starts[group]
    batch = q_lens.shape[0]
    max_q, max_s = int(q_lens.max()), int(seq_lens.max())
    device = q_lens.device
    seq_of_row = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
    row_in_seq = torch.arange(seq_of_row.shape[0], device=device) - \
        torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens)
    tokens = None if group is None else starts[seq_of_row] + row_in_seq
    # Query row r of sequence b sits at absolute position seq_len - q_len + r.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]
    k_pos = torch.arange(max_s, device=device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & \
        (k_pos[None, None, :] < seq_lens[:, None, None])  # [Bp, max_q, S]
    return PrefillPlan(tokens, seq_of_row * max_q + row_in_seq,
                       _slots(tables, max_s, kv_cache.shape[2]), allowed[:, None], batch,
                       max_q, max_s, q_pos, bool(torch.equal(q_lens, seq_lens)))


def plan_attention(meta: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionPlan:
    """Derive the step's :class:`AttentionPlan` from ``meta`` (for a cache shaped like
    ``kv_cache``); one host sync (are all slots written?), one more for a mixed batch."""
    rows = write_rows(meta.slot_mapping)
    if meta.is_decode_only or meta.max_query_len == 1:
        return AttentionPlan(_plan_decode(meta, None, kv_cache), None, rows)
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    is_decode = q_lens == 1
    if not bool(is_decode.any()):
        return AttentionPlan(None, _plan_prefill(meta, None, q_lens, kv_cache), rows)
    return AttentionPlan(_plan_decode(meta, is_decode.nonzero().flatten(), kv_cache),
                         _plan_prefill(meta, (~is_decode).nonzero().flatten(), q_lens, kv_cache),
                         rows)


def windowed_plan(plan: AttentionPlan, window: int) -> AttentionPlan:
    """``plan`` with every mask restricted to the last ``window`` positions (a query at
    position ``i`` sees keys ``i - window < j <= i``); cached in ``plan.windowed``."""
    found = plan.windowed.get(window)
    if found is not None:
        return found
    dec, pre = plan.decode, plan.prefill
    if dec is not None:
        batch, s = dec.seq_lens.shape[0], dec.max_seq_len
        k_pos = _arange(s, dec.seq_lens.device)
        masked = (k_pos >= dec.seq_lens.view(batch, 1, 1, 1)) | \
            (k_pos <= (dec.seq_lens - 1 - window).view(batch, 1, 1, 1))
        heads = dec.bias.shape[0] // batch
        bias = torch.where(masked, float("-inf"), 0.0).expand(batch, heads, 1, s)
        dec = replace(dec, bias=bias.reshape(-1, 1, s))
    if pre is not None:
        k_pos = _arange(pre.max_seq_len, pre.q_pos.device)
        inside = k_pos[None, None, :] > (pre.q_pos - window)[:, :, None]  # [Bp, max_q, S]
        pre = replace(pre, allowed=pre.allowed & inside[:, None], causal=False)
    found = plan.windowed[window] = AttentionPlan(dec, pre, plan.write_rows)
    return found


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``c * tanh(scores / c)`` in place (Gemma 2's attention soft-capping), or ``scores``."""
    return scores if softcap is None else scores.div_(softcap).tanh_().mul_(softcap)


def _group_query(query: torch.Tensor, kv_cache: torch.Tensor, tokens: torch.Tensor | None
                 ) -> tuple[torch.Tensor, int, int, int, torch.dtype]:
    """A group's query rows (all when ``tokens`` is None), ``Hq``, ``Hkv``, ``D`` and the
    compute dtype (float64 for float64 inputs, else float32)."""
    num_heads, head_dim = query.shape[1:]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query if tokens is None else query[tokens]
    return q, num_heads, kv_cache.shape[3], head_dim, acc


def _require(kv_scale: torch.Tensor | None) -> torch.Tensor:
    if kv_scale is None:
        raise ValueError("kv_scale must be a [2, Hkv] float32 tensor for an int8 / fp8 KV "
                         "cache, got None")
    return kv_scale


def _dequantized(kv: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None,
                 head_axis: int, acc: torch.dtype) -> torch.Tensor:
    """Gathered cache bytes ``kv [2, ...]`` (KV heads on ``head_axis``) as ``acc`` values:
    ``float(q) * kv_scale`` for a quantized cache, a cast otherwise."""
    if not is_quantized_cache(kv_cache):
        return _cast(kv, acc)
    shape = [1] * kv.dim()
    shape[0], shape[head_axis] = 2, kv.shape[head_axis]
    return kv.view(kv_cache.dtype).to(acc) * _require(kv_scale).to(acc).view(shape)


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan,
            scale: float, kv_scale: torch.Tensor | None = None,
            softcap: float | None = None,
            rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for the decode rows; ``[Bd, Hq, D]`` float."""
    q, num_heads, num_kv_heads, head_dim, acc = _group_query(query, kv_cache, plan.tokens)
    batch, s = q.shape[0], plan.max_seq_len
    kv = as_bytes(kv_cache).view(2, -1, head_dim).index_select(1, plan.kv_rows)
    if is_quantized_cache(kv_cache):
        kv = _dequantized(kv.view(2, batch, num_kv_heads, s, head_dim), kv_cache, kv_scale, 2,
                          acc)
        q = q.to(acc)
    elif kv.dtype != acc:
        kv, q = kv.to(acc), q.to(acc)
    if rotary_keys is not None:
        # [B, Hkv, S, D] -> [B, S, Hkv, D] for the rotation by position, and back
        keys = rotary_keys.rotate(kv[0].transpose(1, 2), _arange(s, kv.device).long())
        kv = torch.stack((keys.to(acc).transpose(1, 2), kv[1]))
    keys, values = kv.view(2, batch * num_kv_heads, s, head_dim).unbind(0)
    # NOTE: the product makes q contiguous, so [B, Hq, D] views as [B * Hkv, group, D].
    q = (q * scale).view(batch * num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is None:
        scores = torch.baddbmm(_cast(plan.bias, acc), q, keys.transpose(1, 2))
    else:
        scores = _softcapped(torch.bmm(q, keys.transpose(1, 2)), softcap) + _cast(plan.bias, acc)
    probs = scores.softmax(dim=-1)
    return torch.bmm(probs, values).view(batch, num_heads, head_dim)


def _prefill(query: torch.Tensor, kv_cache: torch.Tensor, plan: PrefillPlan,
             scale: float, kv_scale: torch.Tensor | None = None,
             softcap: float | None = None,
             rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
    """Causal attention of the prefill chunks, padded; ``[Tp, Hq, D]`` float."""
    q, num_heads, num_kv_heads, head_dim, acc = _group_query(query, kv_cache, plan.tokens)
    q_pad = q.new_zeros(plan.batch * plan.max_query_len, num_heads, head_dim, dtype=acc)
    q_pad.index_copy_(0, plan.pad_rows, _cast(q, acc))
    q_pad = q_pad.view(plan.batch, plan.max_query_len, num_heads, head_dim)
    kv = as_bytes(kv_cache).view(2, -1, num_kv_heads, head_dim).index_select(1, plan.kv_slots)
    kv = _dequantized(kv.view(2, plan.batch, plan.max_seq_len, num_kv_heads, head_dim),
                      kv_cache, kv_scale, 3, acc)
    if rotary_keys is not None:
        keys = rotary_keys.rotate(kv[0], _arange(plan.max_seq_len, kv.device).long())
        kv = torch.stack((keys.to(acc), kv[1]))
    # NOTE: padded query rows may be fully masked (NaN out); they are dropped below.
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
            attn_mask=None if plan.causal else plan.allowed, is_causal=plan.causal,
            scale=scale, enable_gqa=num_heads > num_kv_heads)
    else:
        out = _softcapped_attention(q_pad.transpose(1, 2), kv[0].transpose(1, 2),
                                    kv[1].transpose(1, 2), plan.allowed, scale, softcap)
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [Bp * max_q, Hq, D]
    return out.index_select(0, plan.pad_rows)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          allowed: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """``softmax(mask(c * tanh(q k^T * scale / c))) v`` for ``q [B, Hq, Q, D]``,
    ``k``/``v [B, Hkv, S, D]`` (GQA: KV head ``h // (Hq / Hkv)`` serves query head ``h``),
    ``allowed [B, 1, Q, S]``: ``[B, Hq, Q, D]``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = _softcapped(torch.matmul(q, k.transpose(-1, -2)).mul_(scale), softcap)
    return scores.masked_fill_(~allowed, float("-inf")).softmax(-1).matmul(v)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, kv_scale: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None,
                    rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
    """Varlen causal attention of new tokens over their cached prefixes (GQA aware).

    Decode sequences (one new token) and prefill chunks are computed as two groups, so a long
    prefill chunk does not pad every decode row to its length. Uses ``meta.plan`` when a
    previous layer made it (:func:`plan_attention`), else makes it.

    Args:
        query: ``[T, Hq, D]``.
        kv_cache: ``[2, NB, BS, Hkv, D]`` already holding this step's keys/values.
        meta: batch layout (see :class:`AttentionMetadata`).
        scale: softmax scale, usually ``D ** -0.5``.
        kv_scale: ``[2, Hkv]`` float32 per-head scales; needed for an ``int8`` / ``fp8``
            cache, which is read as ``float(q) * scale`` (:mod:`nybble.kernels.kv_quant`).
        window: a sliding-window layer's window (tokens a query sees, itself included), or
            None (full causal attention).
        softcap: ``c`` of the scores' soft-capping ``c * tanh(s / c)``, or None.
        rotary_keys: a quantized cache that holds keys before RoPE: their zero point and the
            layer's rotary table, applied as the keys are read
            (:class:`nybble.kernels.kv_quant.RotaryKeys`); None: keys are cached rotated.

    Returns:
        ``[T, Hq, D]`` in ``query.dtype``; computed in float32, or float64 for float64 inputs.

    Raises:
        ValueError: ``rotary_keys`` with a float cache, or a quantized cache without
            ``kv_scale``.
    """
    if rotary_keys is not None and not is_quantized_cache(kv_cache):
        raise ValueError(f"rotary_keys needs a quantized (int8 / fp8_e4m3) KV cache, got "
                         f"{kv_cache.dtype}")
    plan = meta.plan
    if not isinstance(plan, AttentionPlan):
        plan = meta.plan = plan_attention(meta, kv_cache)
    if window is not None:
        plan = windowed_plan(plan, window)
    dec, pre = plan.decode, plan.prefill
    if dec is not None and dec.tokens is None:
        return _cast(_decode(query, kv_cache, dec, scale, kv_scale, softcap, rotary_keys),
                     query.dtype)
    if pre is not None and pre.tokens is None:
        return _cast(_prefill(query, kv_cache, pre, scale, kv_scale, softcap, rotary_keys),
                     query.dtype)
    out = torch.empty_like(query)
    if dec is not None:
        out[dec.tokens] = _decode(query, kv_cache, dec, scale, kv_scale, softcap,
                                  rotary_keys).to(query.dtype)
    if pre is not None:
        out[pre.tokens] = _prefill(query, kv_cache, pre, scale, kv_scale, softcap,
                                   rotary_keys).to(query.dtype)
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class TorchAttentionBackend:
    """The CPU attention backend: :func:`reshape_and_cache` + :func:`paged_attention`, with
    the step's :class:`AttentionPlan` made once (first layer) and reused by the others."""

    name = "torch"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, meta: AttentionMetadata,
                          kv_scale: torch.Tensor | None = None) -> None:
        """See :func:`reshape_and_cache`; the ``-1`` slots are found once per step."""
        plan = meta.plan
        if not isinstance(plan, AttentionPlan):
            plan = meta.plan = plan_attention(meta, kv_cache)
        write_slots(key, value, kv_cache, meta.slot_mapping, plan.write_rows, kv_scale)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scale: torch.Tensor | None = None, window: int | None = None,
                softcap: float | None = None,
                rotary_keys: RotaryKeys | None = None) -> torch.Tensor:
        """See :func:`paged_attention`."""
        return paged_attention(query, kv_cache, meta, scale, kv_scale, window, softcap,
                               rotary_keys)
