"""Data-free calibration: text sampled from the model being quantized.

When ``nybble quantize`` is given no ``--calib`` file it calibrates on sequences the model
writes itself, sampled from BOS at temperature 1 with no top-k / top-p cut (the data-free
scheme of LLM-QAT, Liu et al. 2023, "LLM-QAT: Data-Free Quantization Aware Training for Large
Language Models", section 2.1). Such text follows the model's own next-token distribution, so
its activations cover what the model does on the text it was trained on, in any language or
domain, with no file to ship or download; a user's own text (``--calib``) is still better when
the model will serve one domain.

How many tokens a method needs (:func:`calibration_need`): GPTQ inverts the Gram matrix
``X^T X`` of each Linear's inputs, which is singular with fewer tokens than input channels and
noisy near that; AWQ averages per-channel magnitudes. The rule used here, at least 4 tokens
per input channel of the widest Linear and never under 2,048, is what GPTQ's paper calibrates
with at 7B scale (128 x 2,048 tokens for 4,096-11,008 inputs, Frantar et al. 2023) scaled down
for small models. RTN reads no calibration; its report's output errors use 512 tokens.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

MIN_TOKENS = 2048
"""The fewest calibration tokens :func:`calibration_need` asks of a calibrated method."""

TOKENS_PER_INPUT = 4
"""Calibration tokens per input channel of the widest Linear."""

REPORT_TOKENS = 512
"""Sampled tokens for an RTN run, whose report alone reads them (output errors)."""

SEED = 0
"""Seed of the sampling (the same model and settings give the same calibration)."""

BATCH = 16
"""Sequences sampled at once."""


def calibration_need(method: str, widest_input: int) -> int:
    """Calibration tokens ``method`` needs on a model whose widest quantized Linear has
    ``widest_input`` input channels: ``max(MIN_TOKENS, TOKENS_PER_INPUT * widest_input)`` for
    ``gptq`` / ``gptq-e2e`` / ``awq``; 0 for ``rtn`` (it reads none)."""
    if method == "rtn":
        return 0
    return max(MIN_TOKENS, TOKENS_PER_INPUT * widest_input)


@torch.no_grad()
def sample_calibration_ids(model: nn.Module, num_tokens: int, seq_len: int,
                           max_sequences: int, seed: int = SEED) -> torch.Tensor:
    """Sample text from ``model`` and cut it into calibration windows.

    Each sequence starts at BOS (a token drawn uniformly from the vocabulary for a model
    without one) and is sampled at temperature 1 with no top-k / top-p (every token as likely
    as the model says) until EOS or ``seq_len`` new tokens; the sequences, each with its BOS,
    are concatenated and cut into consecutive windows of ``seq_len`` tokens, as a calibration
    file's paragraphs are (:func:`nybble.quantize.calibration.calibration_ids`). Sampling runs
    inside :func:`torch.random.fork_rng` with ``seed``, so it leaves the caller's random state
    alone and gives the same windows for the same model, settings and thread count.

    Args:
        model: a transformers causal LM (``generate``, ``config.bos_token_id`` /
            ``eos_token_id`` / ``vocab_size``), float weights, on CPU or GPU.
        num_tokens: tokens wanted in all (at least one window's worth is made).
        seq_len: tokens per window (>= 2).
        max_sequences: at most this many windows (``--num-samples``).
        seed: the sampling seed.

    Returns:
        int64 ``[S, seq_len]`` on the CPU, ``S = min(max_sequences, ceil(num_tokens /
        seq_len))`` (fewer, or one shorter window, only if the model kept ending its text at
        once).

    Raises:
        ValueError: ``num_tokens < 1``, ``seq_len < 2`` or ``max_sequences < 1``.
    """
    if num_tokens < 1 or seq_len < 2 or max_sequences < 1:
        raise ValueError(f"num_tokens and max_sequences must be >= 1 and seq_len >= 2, got "
                         f"{num_tokens}, {max_sequences}, {seq_len}")
    windows = min(max_sequences, math.ceil(num_tokens / seq_len))
    wanted = windows * seq_len
    cfg = model.config
    bos, vocab = cfg.bos_token_id, cfg.vocab_size
    eos = _eos_ids(cfg)
    device = next(model.parameters()).device
    stream: list[int] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        # NOTE: a model that ends every text at once still stops: at most 4x the batches
        for _ in range(4 * math.ceil(wanted / (BATCH * seq_len)) + 1):
            if len(stream) >= wanted:
                break
            if bos is None:
                start = torch.randint(0, vocab, (BATCH, 1))
            else:
                start = torch.full((BATCH, 1), int(bos))
            out = model.generate(start.to(device), attention_mask=torch.ones_like(start).to(
                device), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=seq_len, min_new_tokens=1, pad_token_id=eos[0] if eos else 0,
                eos_token_id=eos or None)
            for row in out.tolist():
                stream += _until_eos(row, eos)
    length = min(seq_len, len(stream))   # a model that wrote less: one shorter window
    n = max(1, min(windows, len(stream) // length))
    return torch.tensor([stream[i * length:(i + 1) * length] for i in range(n)],
                        dtype=torch.int64)


def _eos_ids(cfg: Any) -> list[int]:
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _until_eos(row: list[int], eos: list[int]) -> list[int]:
    """``row`` up to and including its first EOS after the start token (the rest is
    padding)."""
    for i, tok in enumerate(row[1:], start=1):
        if tok in eos:
            return row[:i + 1]
    return row
