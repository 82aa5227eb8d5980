"""Perplexity with a sliding window, and greedy-token agreement between two models.

Text is split into paragraphs (blank-line separated, one story each in the shared data);
each paragraph is tokenized with BOS and every token after BOS is scored. A paragraph longer
than ``window`` tokens is scored with a sliding window: windows of ``window`` tokens advance by
``stride``, and each window scores only the tokens not scored by the previous one (the
Hugging Face "perplexity of fixed-length models" recipe).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def split_paragraphs(text: str, max_paragraphs: int | None = None) -> list[str]:
    """Non-empty blank-line separated paragraphs (first ``max_paragraphs`` if given)."""
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    return paras if max_paragraphs is None else paras[:max_paragraphs]


@torch.no_grad()
def sequence_nll(model: nn.Module, ids: list[int], window: int, stride: int
                 ) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ``ids[1:]`` and the number of tokens scored.

    Raises:
        ValueError: ``stride`` not in ``[1, window]``.
    """
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    total, count, prev_end = 0.0, 0, 1  # position 0 (BOS) is never scored
    begin = 0
    while prev_end < len(ids):
        end = min(begin + window, len(ids))
        chunk = torch.tensor([ids[begin:end]], dtype=torch.int64)
        logits = model(input_ids=chunk, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        targets = chunk[0, 1:]
        first = prev_end - begin - 1  # index into targets of the first unscored token
        nll = -logp[first:].gather(1, targets[first:].unsqueeze(1)).sum()
        total += float(nll)
        count += end - prev_end
        prev_end = end
        begin += stride
    return total, count


def perplexity(model: nn.Module, tokenizer: Any, text: str, window: int = 512,
               stride: int = 256, max_paragraphs: int | None = None) -> dict[str, float]:
    """Perplexity of ``text`` under ``model``.

    Returns:
        ``{"perplexity", "nll_per_token", "tokens", "paragraphs"}``.
    """
    total, count = 0.0, 0
    paras = split_paragraphs(text, max_paragraphs)
    for p in paras:
        ids = tokenizer(p)["input_ids"]
        nll, n = sequence_nll(model, ids, window, stride)
        total, count = total + nll, count + n
    if count == 0:
        raise ValueError("text must contain at least one scorable token, got none")
    return {"perplexity": math.exp(total / count), "nll_per_token": total / count,
            "tokens": float(count), "paragraphs": float(len(paras))}


@torch.no_grad()
def greedy_continuations(ref: nn.Module, prompts: list[list[int]],
                         max_new_tokens: int = 32) -> list[list[int]]:
    """Prompt + ``max_new_tokens`` greedy tokens of ``ref`` for every prompt."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.int64)
        for _ in range(max_new_tokens):
            nxt = ref(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(ids[0].tolist())
    return out


@torch.no_grad()
def greedy_agreement(other: nn.Module, sequences: list[list[int]],
                     prompt_lens: list[int]) -> float:
    """Fraction of generated positions where ``other``'s argmax equals the reference token.

    ``sequences`` come from :func:`greedy_continuations` of the reference model; ``other`` is
    run teacher-forced on them (one early difference does not derail the rest).
    """
    agree, total = 0, 0
    for seq, plen in zip(sequences, prompt_lens):
        ids = torch.tensor([seq[:-1]], dtype=torch.int64)
        pred = other(input_ids=ids, use_cache=False).logits[0].argmax(dim=-1)
        gen = torch.tensor(seq[plen:])
        agree += int((pred[plen - 1:] == gen).sum())
        total += gen.numel()
    return agree / total
