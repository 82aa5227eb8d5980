"""Verification of speculative tokens: the rejection-sampling rule of speculative decoding.

Speculative sampling (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"): given drafts ``d_1..d_m`` drawn from a proposal ``q`` and the
target's distributions ``p_1..p_{m+1}`` at the same positions (one forward), accept ``d_i``
with probability ``min(1, p_i(d_i) / q_i(d_i))``, stop at the first rejection and draw its
replacement from ``norm(max(0, p_i - q_i))``; if all ``m`` are accepted, draw a bonus token from
``p_{m+1}``. Every emitted token is then distributed exactly as the target's own sample.

Both of nybble's proposers are deterministic (the draft model proposes its argmax, n-gram
lookup a copy), so ``q_i`` is one-hot on ``d_i``: ``d_i`` is accepted with probability
``p_i(d_i)``, and the replacement is drawn from ``p_i`` with ``d_i`` removed, renormalised.
This is realised by coupling: at every verified position the target draws its own token
``t_i ~ p_i`` (the sampler's exponential race, ``argmax(p_i / E)``), and ``d_i`` is accepted
iff ``d_i == t_i`` -- probability ``p_i(d_i)`` -- while on a rejection ``t_i`` is emitted,
which given ``t_i != d_i`` is distributed as ``p_i`` without ``d_i``: the rule above, exactly.
A greedy row (temperature 0) thus accepts ``d_i`` iff it is ``argmax p_i``: the output is the
target's greedy output token for token. ``p`` is the target's distribution after the
request's logit shaping at that position (:class:`~nybble.runtime.sample.shaping_rows.VerifyLayout`:
``min_tokens``, bias, bad words, penalties) and its temperature, top-k, top-p and min-p
(:mod:`nybble.runtime.sample.sampler`). The rule is exact for any proposal ``q``, so the proposers
never shape: a draft the shaping bans (``p_i(d_i) = 0``) is simply rejected.

A seeded request draws the noise of each position from a generator seeded by its own seed and
the position (:func:`position_seed`), so its tokens depend neither on the batch nor on how
the scheduler split its proposals (budget, preemption).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nybble.runtime.sample.sampler import SamplingBatch, filter_logits, row_argmax


@dataclass(slots=True)
class VerifyOutput:
    """The tokens one speculative step emits, ``S`` sample rows, ``W = 1 + max m`` columns.

    Attributes:
        token_ids: ``int32[S, W]``; row ``r`` holds its accepted drafts then the target's
            token in ``[:counts[r]]`` (the rest is padding).
        counts: ``int32[S]`` tokens emitted (accepted drafts + 1).
        logprobs: ``float32[S, W]`` log-probability of each emitted token under the target's
            raw logits at its position, or ``None`` when no row asked for logprobs.
        top_token_ids, top_logprobs: ``[S, W, k]`` the ``k`` most likely ids at each
            position, or ``None``.
    """

    token_ids: np.ndarray
    counts: np.ndarray
    logprobs: np.ndarray | None
    top_token_ids: np.ndarray | None
    top_logprobs: np.ndarray | None


def _expand(params: SamplingBatch, row_of: torch.Tensor) -> SamplingBatch:
    """``params`` of ``S`` sample rows repeated for their logits rows (``row_of[i]``: the
    sample row of logits row ``i``), random rows only."""
    random = params.temperature[row_of] > 0
    rows = random.nonzero().flatten()
    src = row_of[rows]
    return SamplingBatch(params.temperature[src], params.top_p[src], params.top_k[src],
                         params.min_p[src], [params.generators[i] for i in src.tolist()], -1,
                         rows, all_greedy=rows.numel() == 0,
                         use_top_k_top_p=params.use_top_k_top_p, use_min_p=params.use_min_p)


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded sample's noise at token ``position`` (splitmix64 of the pair)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def _noise(sub: SamplingBatch, positions: list[int], vocab: int,
           default: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``Exp(1)`` noise ``[R, vocab]`` for the random logits rows: rows without a seed from
    ``default``, a seeded row from its seed and its token's position."""
    noise = torch.empty(len(positions), vocab, device=device)
    unseeded = [i for i, g in enumerate(sub.generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=device
                                      ).exponential_(generator=default)
    for i, gen in enumerate(sub.generators):
        if gen is not None:
            g = torch.Generator(device=device).manual_seed(
                position_seed(gen.initial_seed(), positions[i]))
            noise[i].exponential_(generator=g)
    return noise


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor, num_draft: np.ndarray,
                     positions: np.ndarray, params: SamplingBatch,
                     generator: torch.Generator | None,
                     raw_logits: torch.Tensor | None = None) -> VerifyOutput:
    """Verify the drafts of ``S`` sample rows (see the module docstring for the rule).

    Args:
        logits: ``[N, vocab]`` target logits, ``N = sum(num_draft + 1)``: sample row ``r``
            owns ``num_draft[r] + 1`` consecutive rows, the distributions of the positions of
            its drafts then of the bonus token.
        draft_ids: ``[N]`` int64, the draft each logits row judges (any value on bonus rows).
        num_draft: ``int32[S]`` drafts ``m`` per sample row (0: an ordinary sample).
        positions: ``int64[N]`` the position the token of each logits row takes (tokens).
        params: sampling parameters of the ``S`` sample rows.
        generator: generator of the rows without a seed.
        raw_logits: the model's logits before logit shaping, when ``logits`` are shaped:
            logprobs are reported under these (as :func:`~nybble.runtime.sample.sampler.sample`).

    Returns:
        :class:`VerifyOutput`.
    """
    device = logits.device
    logits = logits.float()
    S, N, vocab = len(num_draft), logits.shape[0], logits.shape[1]
    m = num_draft.astype(np.int64)
    starts = np.cumsum(m + 1) - (m + 1)
    target = row_argmax(logits)
    if not params.all_greedy:
        row_of = torch.from_numpy(np.repeat(np.arange(S), m + 1)).to(device)
        sub = _expand(params, row_of)
        if sub.random_rows.numel():
            rr = sub.random_rows
            probs = filter_logits(logits[rr], sub).softmax(dim=-1)
            noise = _noise(sub, positions[rr.cpu().numpy()].tolist(), vocab, generator, device)
            target[rr] = row_argmax(probs / noise)
    # the acceptance arithmetic on the host: S rows of at most W = 1 + max m columns
    t, d = target.cpu().numpy(), draft_ids.cpu().numpy()
    W = int(m.max()) + 1 if S else 1
    cols = np.arange(W)
    index = np.minimum(starts[:, None] + cols[None, :], max(N - 1, 0))     # [S, W]
    accept = (t[index] == d[index]) & (cols[None, :] < m[:, None])   # drafts only, not bonus
    accepted = np.cumprod(accept, axis=1).sum(axis=1)                     # [S]
    chosen = np.where(cols[None, :] < accepted[:, None], d[index],
                      t[starts + accepted][:, None])
    chosen = np.where(cols[None, :] <= accepted[:, None], chosen, 0).astype(np.int32)
    out = VerifyOutput(chosen, (accepted + 1).astype(np.int32), None, None, None)
    if params.max_logprobs >= 0:
        logprobs = (logits if raw_logits is None else raw_logits.float()).log_softmax(dim=-1)
        index_t = torch.from_numpy(index).to(device)
        chosen_t = torch.from_numpy(chosen.astype(np.int64)).to(device)
        out.logprobs = logprobs[index_t].gather(-1, chosen_t[:, :, None])[:, :, 0].cpu().numpy()
        if params.max_logprobs > 0:
            top_lp, top_ids = logprobs.topk(params.max_logprobs, dim=-1)
            out.top_token_ids = top_ids[index_t].cpu().numpy()
            out.top_logprobs = top_lp[index_t].cpu().numpy()
    return out
