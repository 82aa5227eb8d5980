"""Per-head KV-cache scales for an ``int8`` / ``fp8_e4m3`` cache, calibrated at start-up.

One prefill of :data:`CALIBRATION_TOKENS` pseudo-random token ids (fixed seed) through the
model with a float scratch cache; for each layer, K/V and KV head the scale is
``CALIBRATION_MARGIN * absmax / qmax`` (``qmax`` 127 for int8, 448 for fp8 e4m3), so the
calibrated range maps onto the dtype's grid with headroom for activations larger than the
calibration's. Values past that range saturate (clamped). Why random ids and this margin, and
the perplexity it gives, are in docs/kv-cache.md. Deterministic: the same model gives the same
scales.
"""
from __future__ import annotations

import torch

from nybble.kernels.kv_quant import QMAX
from nybble.models.loader import LoadedModel
from nybble.models.scoring import prefill_logits

CALIBRATION_TOKENS = 512
"""Tokens of the calibration prefill (fewer when ``max_model_len`` is shorter)."""

CALIBRATION_MARGIN = 2.0
"""Headroom over the calibration absmax: on the held-out stories the keys and values of real
text reach up to 1.6x (stories3m) and 1.8x (stories260k) of what random ids give, per head;
2x covers that, at the cost of one bit of int8 resolution (docs/kv-cache.md)."""

_SEED = 1234


def calibration_token_ids(vocab_size: int, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids drawn uniformly from ``[0, vocab_size)`` with a fixed seed."""
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()


@torch.inference_mode()
def calibrate_kv_scales(loaded: LoadedModel, cache_dtype: torch.dtype,
                        device: torch.device) -> list[torch.Tensor]:
    """Calibrate and install the per-head scales of a quantized KV cache.

    Runs one float-cache prefill (the attention layers' ``kv_scale`` must still be ``None``),
    then sets ``layer.self_attn.kv_scale`` of every layer.

    Args:
        loaded: the model.
        cache_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
        device: where the model lives.

    Returns:
        One ``[2, Hkv]`` float32 tensor per layer (keys row 0, values row 1), as installed.

    Raises:
        ValueError: ``cache_dtype`` is not a quantized cache dtype.
    """
    if cache_dtype not in QMAX:
        raise ValueError(f"cache_dtype must be int8 or float8_e4m3fn, got {cache_dtype}")
    attns = [layer.self_attn for layer in loaded.model.layers]
    for attn in attns:
        attn.kv_scale = None
    num_tokens = min(CALIBRATION_TOKENS, loaded.max_model_len)
    ids = calibration_token_ids(loaded.shape.vocab_size, num_tokens)
    caches: list[torch.Tensor] = []
    prefill_logits(loaded, [ids], device, keep_caches=caches)
    scales = []
    for attn, cache in zip(attns, caches):
        # cache [2, NB, BS, Hkv, D] -> absmax per (K/V, head) over every token and dim
        absmax = cache.float().abs().amax(dim=(1, 2, 4))
        scale = (absmax * CALIBRATION_MARGIN / QMAX[cache_dtype]).clamp_(min=1e-8)
        attn.kv_scale = scale.to(device=device, dtype=torch.float32).contiguous()
        scales.append(attn.kv_scale)
    return scales
