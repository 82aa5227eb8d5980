"""Seeded synthetic request sets for the benchmarks.

Two shapes, as in vLLM's benchmark datasets:

* ``mixed`` (default): prompt and output lengths drawn from log-normal distributions, the
  long-tailed shape of real chat traffic (ShareGPT-like). The prompt median is
  ``prompt_median_frac`` (1/3) of the context budget; outputs have median
  ``output_median_frac`` (1/6) of the budget and are clipped to ``[min_output_len, budget -
  prompt_len]``, so every request fits ``max_model_len``.
* ``fixed``: every request has ``input_len`` prompt tokens and ``output_len`` output tokens
  (``vllm bench throughput --input-len --output-len``).

Prompt tokens are drawn uniformly from the tokenizer's non-special vocabulary (capped at the
model's ``vocab_size``, so a random-weights model with a larger embedding works too) or cut
from a text file (``--dataset``) at random offsets. Prompts are token ids, BOS first when the
tokenizer has one, so both backends see exactly the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MIN_PROMPT_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt's token ids and the exact number of tokens to generate.

    Attributes:
        prompt_token_ids: prompt ids (BOS included when the tokenizer has one).
        output_len: tokens to generate (``ignore_eos``), ``>= 1``.
    """

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadConfig:
    """How to build a request set.

    Attributes:
        kind: ``mixed`` (log-normal lengths) or ``fixed``.
        num_requests: number of requests.
        context_budget: most tokens per request, prompt + output (use ``max_model_len``).
        prompt_median_frac: prompt median as a fraction of ``context_budget`` (mixed).
        output_median_frac: output median as a fraction of ``context_budget`` (mixed).
        sigma: log-normal shape (standard deviation of the log length) for both (mixed).
        min_output_len: shortest output in tokens (mixed).
        input_len, output_len: the fixed set's lengths in tokens.
        dataset: text file to cut prompts from; ``None``: random vocabulary tokens.
        seed: seed of the generator; the same seed gives the same set.
    """

    kind: str = "mixed"
    num_requests: int = 256
    context_budget: int = 512
    prompt_median_frac: float = 1 / 3
    output_median_frac: float = 1 / 6
    sigma: float = 0.6
    min_output_len: int = 8
    input_len: int = 128
    output_len: int = 128
    dataset: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("mixed", "fixed"):
            raise ValueError(f"workload kind must be 'mixed' or 'fixed', got {self.kind!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.context_budget < _MIN_PROMPT_LEN + self.min_output_len:
            raise ValueError(f"context_budget must be >= {_MIN_PROMPT_LEN + self.min_output_len}"
                             f" tokens, got {self.context_budget}")
        if self.kind == "fixed" and self.input_len + self.output_len > self.context_budget:
            raise ValueError(f"input_len + output_len must be <= context_budget "
                             f"({self.context_budget}), got {self.input_len + self.output_len}")


def sample_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``(prompt_lens, output_lens)``, int64 arrays of ``cfg.num_requests`` token counts.

    Every pair satisfies ``prompt_len >= 4``, ``output_len >= 1`` and
    ``prompt_len + output_len <= cfg.context_budget``.
    """
    n = cfg.num_requests
    if cfg.kind == "fixed":
        return np.full(n, cfg.input_len, np.int64), np.full(n, cfg.output_len, np.int64)
    budget = cfg.context_budget
    p_med = cfg.prompt_median_frac * budget
    o_med = cfg.output_median_frac * budget
    prompt = np.rint(rng.lognormal(np.log(p_med), cfg.sigma, n)).astype(np.int64)
    prompt = np.clip(prompt, _MIN_PROMPT_LEN, budget - cfg.min_output_len)
    out = np.rint(rng.lognormal(np.log(o_med), cfg.sigma, n)).astype(np.int64)
    out = np.clip(out, cfg.min_output_len, budget - prompt)
    return prompt, out


def _token_pool(tokenizer: object, vocab_size: int) -> np.ndarray:
    """Ids of the tokenizer's non-special tokens below ``vocab_size`` (int64)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    n = min(len(tokenizer), vocab_size)  # type: ignore[arg-type]
    pool = np.array([i for i in range(n) if i not in special], dtype=np.int64)
    if pool.size == 0:
        raise ValueError("the tokenizer has no non-special tokens below the model's vocab size")
    return pool


def _dataset_tokens(tokenizer: object, path: str, vocab_size: int) -> np.ndarray:
    """The whole text file ``path`` tokenized without special tokens (int64)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"],  # type: ignore
                     dtype=np.int64)
    ids = ids[ids < vocab_size]
    if ids.size < _MIN_PROMPT_LEN:
        raise ValueError(f"dataset {path!r} holds fewer than {_MIN_PROMPT_LEN} tokens")
    return ids


def build_requests(cfg: WorkloadConfig, tokenizer: object,
                   vocab_size: int | None = None) -> list[BenchRequest]:
    """Build ``cfg.num_requests`` requests, deterministic in ``cfg.seed``.

    Args:
        tokenizer: a transformers tokenizer (its vocabulary, BOS and specials are used).
        vocab_size: the model's vocabulary size; ids never reach it. Default: the tokenizer's.
    """
    rng = np.random.default_rng(cfg.seed)
    vocab = vocab_size or len(tokenizer)  # type: ignore[arg-type]
    prompt_lens, output_lens = sample_lengths(cfg, rng)
    bos = getattr(tokenizer, "bos_token_id", None)
    head = [int(bos)] if bos is not None else []
    text_ids = _dataset_tokens(tokenizer, cfg.dataset, vocab) if cfg.dataset else None
    pool = None if text_ids is not None else _token_pool(tokenizer, vocab)
    requests = []
    for p_len, o_len in zip(prompt_lens.tolist(), output_lens.tolist()):
        body_len = p_len - len(head)
        if text_ids is not None:
            start = int(rng.integers(0, text_ids.size))
            body = np.take(text_ids, np.arange(start, start + body_len), mode="wrap")
        else:
            body = rng.choice(pool, size=body_len)  # type: ignore[arg-type]
        requests.append(BenchRequest(head + body.tolist(), int(o_len)))
    return requests


def describe(requests: list[BenchRequest]) -> dict[str, float | int]:
    """Length statistics of a request set (tokens): counts, means, medians, maxima."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])
    return {"num_requests": len(requests), "total_prompt_tokens": int(p.sum()),
            "total_output_tokens": int(o.sum()), "prompt_len_mean": float(p.mean()),
            "prompt_len_median": float(np.median(p)), "prompt_len_max": int(p.max()),
            "output_len_mean": float(o.mean()), "output_len_median": float(np.median(o)),
            "output_len_max": int(o.max())}
