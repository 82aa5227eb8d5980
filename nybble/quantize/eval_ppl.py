"""Perplexity with a sliding window, and greedy-token agreement between two models.

Text is split into paragraphs (blank-line separated, one story each in the shared data);
each paragraph is tokenized with BOS and every token after BOS is scored. A paragraph longer
than ``window`` tokens is scored with a sliding window: windows of ``window`` tokens advance by
``stride``, and each window scores only the tokens not scored by the previous one (the
Hugging Face "perplexity of fixed-length models" recipe).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LogitsFn = Callable[[list[int]], torch.Tensor]
"""Token ids ``[L]`` -> float logits ``[L, vocab]`` (position ``i`` predicts token ``i+1``)."""


def hf_logits_fn(model: nn.Module) -> LogitsFn:
    """Adapt a transformers causal LM to :data:`LogitsFn`."""
    @torch.no_grad()
    def fn(ids: list[int]) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids], dtype=torch.int64), use_cache=False)
        return out.logits[0].float()
    return fn


def nybble_model(model_dir: str, quantization: str | None = None,
                 cpu_activation_dtype: str = "auto") -> tuple[Any, LogitsFn]:
    """nybble's own model for ``model_dir`` (what ``nybble serve`` runs), float32 on CPU, its
    quantized matmuls with ``cpu_activation_dtype`` activations (``ModelConfig``'s choices;
    ``float32`` is the exact path) and the KV cache dtype ``serve`` gives it by default
    (bfloat16 on the rounding paths,
    :func:`~nybble.runtime.worker.kv_plan.resolve_kv_cache_dtype`): ``(LoadedModel, logits
    function)``."""
    from nybble.config import ModelConfig
    from nybble.kernels import get_attention_backend
    from nybble.models.loader import load_model
    from nybble.models.scoring import prefill_logits
    from nybble.runtime.worker.kv_plan import model_kv_storage_dtype

    device = torch.device("cpu")
    loaded = load_model(ModelConfig(model=model_dir, quantization=quantization,
                                    dtype="float32", device="cpu",
                                    cpu_activation_dtype=cpu_activation_dtype),
                        get_attention_backend("torch", device), device)
    cache = model_kv_storage_dtype("auto", loaded.dtype, loaded.cpu_activations)
    return loaded, lambda ids: prefill_logits(loaded, [ids], device, cache)[0]


def nybble_logits_fn(model_dir: str, quantization: str | None = None,
                     cpu_activation_dtype: str = "auto") -> LogitsFn:
    """The logits function of :func:`nybble_model` (what ``nybble eval-ppl`` scores with)."""
    return nybble_model(model_dir, quantization, cpu_activation_dtype)[1]


def split_paragraphs(text: str, max_paragraphs: int | None = None) -> list[str]:
    """Non-empty blank-line separated paragraphs (first ``max_paragraphs`` if given)."""
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    return paras if max_paragraphs is None else paras[:max_paragraphs]


@torch.no_grad()
def sequence_nll(logits_fn: LogitsFn, ids: list[int], window: int, stride: int
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
        chunk = torch.tensor(ids[begin:end], dtype=torch.int64)
        logp = torch.log_softmax(logits_fn(ids[begin:end])[:-1].float(), dim=-1)
        targets = chunk[1:]
        first = prev_end - begin - 1  # index into targets of the first unscored token
        nll = -logp[first:].gather(1, targets[first:].unsqueeze(1)).sum()
        total += float(nll)
        count += end - prev_end
        prev_end = end
        begin += stride
    return total, count


def perplexity(logits_fn: LogitsFn, tokenizer: Any, text: str, window: int = 512,
               stride: int = 256, max_paragraphs: int | None = None) -> dict[str, float]:
    """Perplexity of ``text`` under the model behind ``logits_fn``.

    Returns:
        ``{"perplexity", "nll_per_token", "tokens", "paragraphs"}``.
    """
    total, count = 0.0, 0
    paras = split_paragraphs(text, max_paragraphs)
    for p in paras:
        ids = tokenizer(p)["input_ids"]
        nll, n = sequence_nll(logits_fn, ids, window, stride)
        total, count = total + nll, count + n
    if count == 0:
        raise ValueError("text must contain at least one scorable token, got none")
    return {"perplexity": math.exp(total / count), "nll_per_token": total / count,
            "tokens": float(count), "paragraphs": float(len(paras))}


@torch.no_grad()
def greedy_continuations(ref: LogitsFn, prompts: list[list[int]],
                         max_new_tokens: int = 32) -> list[list[int]]:
    """Prompt + ``max_new_tokens`` greedy tokens of ``ref`` for every prompt."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            ids.append(int(ref(ids)[-1].argmax()))
        out.append(ids)
    return out


@torch.no_grad()
def greedy_agreement(other: LogitsFn, sequences: list[list[int]],
                     prompt_lens: list[int]) -> float:
    """Fraction of generated positions where ``other``'s argmax equals the reference token.

    ``sequences`` come from :func:`greedy_continuations` of the reference model; ``other`` is
    run teacher-forced on them (one early difference does not derail the rest).
    """
    agree, total = 0, 0
    for seq, plen in zip(sequences, prompt_lens):
        pred = other(seq[:-1]).argmax(dim=-1)
        gen = torch.tensor(seq[plen:])
        agree += int((pred[plen - 1:] == gen).sum())
        total += gen.numel()
    return agree / total
