"""Logit shaping written from the formulas, one row at a time in numpy float32: the reference
the runner's batched, on-device implementation is checked against.

- ``allowed_token_ids``: every other id is ``-inf`` (vLLM); ``logit_bias``: added (OpenAI);
- ``bad_words`` (vLLM): a word's last id is ``-inf`` when the output ends with its other ids;
- ``repetition_penalty`` (Keskar et al. 2019; transformers' and vLLM's rule): every id in the
  prompt or the output has its logit divided by the penalty when positive, multiplied
  otherwise;
- OpenAI: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the
  output's counts;
- ``min_tokens``: the stop ids are ``-inf`` while the output is shorter than ``min_tokens``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nybble.sampling_params import SamplingParams

NEG_INF = np.float32(-np.inf)


def reference(logits: np.ndarray, p: SamplingParams, prompt: Sequence[int],
              output: list[int], stop_ids: Sequence[int],
              bad_words: Sequence[Sequence[int]]) -> np.ndarray:
    """The shaped ``[vocab]`` float32 row of ``logits`` after ``output`` was generated."""
    vocab = logits.shape[0]
    x = logits.astype(np.float32).copy()
    if p.allowed_token_ids:
        keep = set(p.allowed_token_ids)
        for t in range(vocab):
            if t not in keep:
                x[t] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        x[t] = np.float32(x[t] + np.float32(b))
    for word in bad_words:
        prefix = list(word[:-1])
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = NEG_INF
    seen = set(prompt) | set(output)
    rep = np.float32(p.repetition_penalty)
    for t in range(vocab):
        if t in seen and p.repetition_penalty != 1.0:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        count = output.count(t)
        if p.frequency_penalty or p.presence_penalty:
            x[t] = x[t] - np.float32(p.frequency_penalty) * np.float32(count)
            x[t] = x[t] - np.float32(p.presence_penalty) * np.float32(count > 0)
    if len(output) < p.min_tokens:
        for t in stop_ids:
            x[t] = NEG_INF
    return x
