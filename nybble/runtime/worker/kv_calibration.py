"""KV-cache scales (and key smoothing) for an ``int8`` / ``fp8_e4m3`` cache, calibrated at start-up.

One prefill of :data:`CALIBRATION_TOKENS` pseudo-random token ids (fixed seed) through the
model with a float scratch cache. Values get a per-head scale ``CALIBRATION_MARGIN * absmax /
qmax`` (``qmax`` 127 for int8, 448 for fp8 e4m3). Keys are first centred and equalised per
channel (:class:`nybble.kernels.kv_quant.KeySmoothing`: a shift to the middle of each
channel's calibrated range, and a factor that moves the query/key product's range from the
key channel to the query), then get a per-head scale over the equalised channels with the same
margin. Values past the calibrated range saturate (clamped). Why random ids, this margin and
the smoothing, with the perplexity and KL divergence they give on three models, are in
docs/kv-cache.md. Deterministic: the same model gives the same scales.
"""
from __future__ import annotations

import torch

from nybble.kernels.kv_quant import QMAX, KeySmoothing, RotaryKeys
from nybble.models.loader import LoadedModel
from nybble.models.scoring import prefill_logits

CALIBRATION_TOKENS = 512
"""Tokens of the calibration prefill (fewer when ``max_model_len`` is shorter)."""

CALIBRATION_MARGIN = 2.0
"""Headroom over the calibration absmax: on the held-out stories the keys and values of real
text reach up to 1.6x (stories3m) and 1.8x (stories260k) of what random ids give, per head;
2x covers that, at the cost of one bit of int8 resolution (docs/kv-cache.md)."""

KEY_FACTOR_FLOOR = 1.0 / 16
"""Smallest per-channel key factor: a channel whose calibrated range is under 1/16 of its
head's widest still gets 1/16 of the grid, so text that swings it wider than random ids did
has room before it saturates (docs/kv-cache.md)."""

_SEED = 1234


def calibration_token_ids(vocab_size: int, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids drawn uniformly from ``[0, vocab_size)`` with a fixed seed."""
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()


@torch.inference_mode()
def calibrate_kv_scales(loaded: LoadedModel, cache_dtype: torch.dtype, device: torch.device,
                        smooth_keys: bool = True, pre_rope: bool = True) -> list[torch.Tensor]:
    """Calibrate and install the scales of a quantized KV cache (and the key smoothing).

    Runs one float-cache prefill of :data:`CALIBRATION_TOKENS` random ids with the layers'
    ``kv_scale``, ``key_smoothing`` and ``rotary_keys`` cleared, then sets them on every layer:

    - keys, cached before RoPE (pre-RoPE key quantization, KVQuant, Hooper et al. 2024) in
      every layer whose rotary embedding is full-width: per channel (KV head x head
      dimension) the calibrated range ``[lo, hi]`` of the keys before their rotation gives a
      shift ``(lo + hi) / 2`` and a half-width ``r``, taken as the larger of the two channels
      of each rotary pair (a per-pair factor commutes with the rotation, so it can move to the
      query); the head's scale is ``CALIBRATION_MARGIN * max(r) / qmax`` and each channel's
      factor ``max(r / max(r), KEY_FACTOR_FLOOR)``
      (:class:`nybble.kernels.kv_quant.KeySmoothing`); the kernels add the shift back and
      rotate as they read (:class:`nybble.kernels.kv_quant.RotaryKeys`). A layer with a partial
      rotary embedding keeps its keys rotated and smooths them after RoPE: the same shift
      (zero in a soft-capped layer, where softmax would not remove it) and per-channel factor;
    - values: per head, ``CALIBRATION_MARGIN * absmax / qmax``.

    Args:
        loaded: the model.
        cache_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        device: where the model lives.
        smooth_keys: ``False`` gives the plain per-head key scales without smoothing (kept
            for the comparison in ``benchmarks/kv_cache_ppl.py``).
        pre_rope: ``False`` smooths every layer's keys after RoPE (the former method, kept for
            the same comparison).

    Returns:
        One ``[2, Hkv]`` float32 tensor per layer (keys row 0, values row 1), as installed.

    Raises:
        ValueError: ``cache_dtype`` is not a quantized cache dtype.
    """
    if cache_dtype not in QMAX:
        raise ValueError(f"cache_dtype must be int8 or float8_e4m3fn, got {cache_dtype}")
    attns = [layer.self_attn for layer in loaded.model.layers]
    for attn in attns:
        attn.kv_scale, attn.key_smoothing, attn.rotary_keys = None, None, None
    loaded.model.drop_ops()
    num_tokens = min(CALIBRATION_TOKENS, loaded.max_model_len)
    ids = calibration_token_ids(loaded.shape.vocab_size, num_tokens)
    caches: list[torch.Tensor] = []
    prefill_logits(loaded, [ids], device, keep_caches=caches)
    qmax = QMAX[cache_dtype]
    scales = []
    for attn, cache in zip(attns, caches):
        # cache [2, NB, BS, Hkv, D]: the sequence fills its first num_tokens slots
        kv = cache.float().flatten(1, 2)[:, :num_tokens]          # [2, T, Hkv, D]
        keys, values = kv[0], kv[1]
        value_scale = values.abs().amax(dim=(0, 2)) * CALIBRATION_MARGIN / qmax
        if smooth_keys:
            rotary = pre_rope and not attn.rope.partial
            if rotary:
                # the calibration cache holds rotated keys; token j sits at position j
                cos, sin = attn.rope.lookup(torch.arange(num_tokens, device=keys.device),
                                            torch.float32)
                keys = attn.rope.unapply(keys, cos, sin)
            lo, hi = keys.amin(dim=0), keys.amax(dim=0)             # [Hkv, D]
            shift = (lo + hi) / 2 if rotary or attn.softcap is None else torch.zeros_like(lo)
            half = torch.maximum(hi - shift, shift - lo).clamp_(min=1e-8)
            if rotary:
                pair = half.shape[1] // 2
                half = torch.maximum(half[:, :pair], half[:, pair:]).repeat(1, 2)
            widest = half.amax(dim=1, keepdim=True)                 # [Hkv, 1]
            factor = (half / widest).clamp_(min=KEY_FACTOR_FLOOR)
            attn.key_smoothing = KeySmoothing(shift.to(device), factor.to(device),
                                              attn.num_heads // attn.num_kv_heads)
            if rotary:
                attn.rotary_keys = RotaryKeys((shift / factor).to(device).contiguous(),
                                              attn.rope.cos_sin)
            key_scale = widest[:, 0] * CALIBRATION_MARGIN / qmax
        else:
            key_scale = keys.abs().amax(dim=(0, 2)) * CALIBRATION_MARGIN / qmax
        scale = torch.stack([key_scale, value_scale]).clamp_(min=1e-8)
        attn.kv_scale = scale.to(device=device, dtype=torch.float32).contiguous()
        scales.append(attn.kv_scale)
    # NOTE: layers with pre-RoPE keys get them unrotated from now on (LayerOps)
    loaded.model.drop_ops()
    return scales
