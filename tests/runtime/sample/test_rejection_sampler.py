"""The rejection-sampling rule of speculative decoding (Leviathan et al. 2023; Chen et al.
2023): greedy rows are exact, random rows emit the target's distribution (chi-square), seeded
rows are reproducible, logprobs are the target's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nybble.runtime.sample.rejection_sampler import rejection_sample
from nybble.runtime.sample.sampler import SamplingBatch


def _params(n: int, temperature: float, top_k: int = -1, seeds: list[int | None] | None = None,
            max_logprobs: int = -1, vocab: int = 6) -> SamplingBatch:
    gens = [None if s is None else torch.Generator().manual_seed(s)
            for s in (seeds or [None] * n)]
    return SamplingBatch.from_tensors(
        torch.full((n,), temperature), torch.ones(n), torch.full((n,), top_k, dtype=torch.int64),
        torch.zeros(n), gens, max_logprobs, vocab)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) at normal quantile z (1e-4 here), Wilson-Hilferty."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


LOGITS = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0],      # position of draft d1
                       [0.3, 1.5, -0.2, 0.1, 0.9, -2.0]])     # bonus position


def test_greedy_accepts_exactly_the_argmax_prefix() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [1.0, 0.0, 0.0],
                           [0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [9.0, 0.0, 0.0]])
    # row 0: drafts (1, 2), both right -> 1 2 + bonus 0; row 1: no drafts -> 0;
    # row 2: drafts (1, 0), the second wrong -> 1 then the argmax 2 (bonus rows: any value)
    m = np.array([2, 0, 2], np.int32)
    drafts = torch.tensor([1, 2, 7, 7, 1, 0, 7])
    out = rejection_sample(logits, drafts, m, np.arange(7), _params(3, 0.0, vocab=3), None)
    assert out.counts.tolist() == [3, 1, 2]
    assert out.token_ids[0].tolist() == [1, 2, 0]
    assert out.token_ids[1, :1].tolist() == [0]
    assert out.token_ids[2, :2].tolist() == [1, 2]


@pytest.mark.parametrize("top_k", [-1, 3])
def test_random_rows_emit_the_target_distribution(top_k: int) -> None:
    """Chi-square: the first emitted token follows p1 (after temperature and top-k) and, when
    the draft was accepted, the next one follows p2, whatever the draft proposed."""
    torch.manual_seed(0)
    n, temperature = 20000, 0.8
    for draft in (3, 5):     # the target's favourite, and a token top-k may remove
        logits = LOGITS.repeat(n, 1)
        drafts = torch.tensor([draft, 0]).repeat(n)
        gen = torch.Generator().manual_seed(draft)
        out = rejection_sample(logits, drafts, np.ones(n, np.int32), np.tile([5, 6], n),
                               _params(n, temperature, top_k), gen)
        p = []
        for row in LOGITS / temperature:
            if top_k > 0:
                row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
            p.append(row.softmax(-1).double().numpy())
        first = out.token_ids[:, 0]
        stat, df = _chi2(np.bincount(first, minlength=6), p[0])
        assert stat < _chi2_critical(df), (draft, stat)
        accepted = out.counts == 2
        assert (first[accepted] == draft).all() and accepted.mean() == pytest.approx(
            p[0][draft], abs=0.02)
        if accepted.sum() > 1000:
            stat, df = _chi2(np.bincount(out.token_ids[accepted, 1], minlength=6), p[1])
            assert stat < _chi2_critical(df), (draft, stat)


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    """A seeded row's token at a position depends on its seed and that position only: not on
    the shared generator, the batch, or how many drafts preceded it."""
    logits = LOGITS.repeat(3, 1)
    drafts = torch.tensor([0, 0, 4, 0, 1, 0])
    m, pos = np.ones(3, np.int32), np.array([7, 8, 7, 8, 7, 8])
    a = rejection_sample(logits, drafts, m, pos, _params(3, 1.0, seeds=[11, 12, None]),
                         torch.Generator().manual_seed(0))
    b = rejection_sample(logits, drafts, m, pos, _params(3, 1.0, seeds=[11, 12, None]),
                         torch.Generator().manual_seed(99))
    for r in (0, 1):
        assert a.token_ids[r, :a.counts[r]].tolist() == b.token_ids[r, :b.counts[r]].tolist()
    alone = rejection_sample(logits[2:4], drafts[2:4], m[:1], pos[:2], _params(1, 1.0, seeds=[12]),
                             None)
    assert alone.token_ids[0, :alone.counts[0]].tolist() == a.token_ids[1, :a.counts[1]].tolist()
    # no draft at position 7: the token there is still the same sample
    plain = rejection_sample(logits[2:3], drafts[2:3], np.zeros(1, np.int32), pos[:1],
                             _params(1, 1.0, seeds=[12]), None)
    assert plain.token_ids[0, 0] == a.token_ids[1, 0]


def test_logprobs_are_the_targets_at_each_emitted_position() -> None:
    logits = LOGITS.clone()
    out = rejection_sample(logits, torch.tensor([3, 0]), np.ones(1, np.int32), np.arange(2),
                           _params(1, 0.0, max_logprobs=2), None)
    ref = LOGITS.double().log_softmax(-1)
    assert out.counts.tolist() == [2] and out.token_ids[0].tolist() == [3, 1]
    np.testing.assert_allclose(out.logprobs[0], [ref[0, 3], ref[1, 1]], rtol=1e-5)
    assert out.top_token_ids[0].tolist() == [[3, 0], [1, 4]]
    np.testing.assert_allclose(out.top_logprobs[0, 1], [ref[1, 1], ref[1, 4]], rtol=1e-5)
