"""Logit shaping of a speculative step's verified positions (``VerifyLayout``), against the
formulas (``shaping_reference``) applied to the output each position follows: the output so
far plus the sample's drafts before it. Then the rejection sampler on the shaped rows: greedy
exact, and the emitted distribution the shaped target's (chi-square, small vocabulary)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.runtime.sample.logit_shaping import LogitShaping
from nybble.runtime.sample.rejection_sampler import rejection_sample
from nybble.runtime.sample.shaping_rows import VerifyLayout
from tests.runtime.sample.test_logit_shaping import CASES, V, _request, reference
from tests.runtime.sample.test_rejection_sampler import LOGITS, _chi2, _chi2_critical, _params


def _layout(num_draft: list[int], drafts: list[list[int]]) -> VerifyLayout:
    """Drafts per sample; the bonus rows judge nothing (-1)."""
    flat = [t for ds in drafts for t in [*ds, -1]]
    return VerifyLayout.from_num_drafts(np.array(num_draft, np.int32), np.array(flat))


def test_layout_offsets_and_preceding_drafts() -> None:
    layout = _layout([2, 0, 3], [[7, 8], [], [4, 5, 6]])
    assert layout.offsets.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    k, toks = layout.preceding(np.array([0, 1, 2, 3, 7]))
    assert k.tolist() == [1, 2, 2, 4, 4, 4] and toks.tolist() == [7, 7, 8, 4, 5, 6]
    assert layout.history(6) == [4, 5] and layout.history(3) == []
    assert layout.history(6, [9]) == [9, 4, 5] and layout.history(6, None) is None


@pytest.mark.parametrize("num_draft", [0, 1, 4])
def test_each_verified_position_is_shaped_as_without_speculation(num_draft: int) -> None:
    """Every shaping case (bias, allowed ids, single- and multi-token bad words, the three
    penalties, min_tokens with stop ids), plus an unshaped sequence, over several speculative
    steps with different numbers of drafts and emitted tokens: row ``j`` of a sample equals
    the formula after its output and its drafts ``0 .. j-1``; the state after accepting
    equals one token at a time."""
    gen = np.random.default_rng(num_draft)
    torch.manual_seed(num_draft)
    shaping = LogitShaping(V, torch.device("cpu"), capacity=2)
    seq_ids = [10 * i for i in range(len(CASES))]
    for sid, req in zip(seq_ids, CASES):
        shaping.add(sid, req)
    seq_ids.insert(2, 100)             # unshaped
    outputs: dict[int, list[int]] = {s: [] for s in seq_ids}
    for step in range(5):
        m = np.array([max(0, num_draft - (i + step) % 3) for i in range(len(seq_ids))],
                     np.int32)
        # drafts that hit the bad words' prefixes, repeat tokens, and propose the stop ids
        drafts = [gen.choice([0, 11, 20, 21, 30, 31, 40, 41, 6, 1], int(k)).tolist()
                  for k in m]
        layout = _layout(m.tolist(), drafts)
        rows = np.repeat(np.array(seq_ids, np.int64), m + 1)
        logits = torch.randn(len(rows), V) * 4
        shaped = shaping.apply(logits, rows, layout)
        for i, sid in enumerate(rows.tolist()):
            j = int(layout.offsets[i])
            if sid == 100:
                assert torch.equal(shaped[i], logits[i])
                continue
            prior = outputs[sid] + layout.history(i)
            np.testing.assert_array_equal(
                shaped[i].numpy(), reference(logits[i].numpy(), CASES[sid // 10], prior),
                err_msg=f"case {sid // 10} step {step} offset {j}")
        # emit 1..m+1 tokens per sample: an accepted prefix of the drafts, then another token
        counts = np.array([gen.integers(1, k + 2) for k in m], np.int32)
        tokens = np.zeros((len(seq_ids), int(m.max()) + 1), np.int32)
        for r, (ds, c) in enumerate(zip(drafts, counts)):
            tokens[r, :c] = [*ds[:c - 1], int(gen.integers(0, V))]
            outputs[seq_ids[r]] += tokens[r, :c].tolist()
        assert shaping.accept(np.array(seq_ids, np.int64), tokens, counts) == []
    for sid in seq_ids:
        if sid == 100:
            continue
        assert shaping.output_len(sid) == len(outputs[sid])
        if CASES[sid // 10].params.penalized:
            np.testing.assert_array_equal(shaping.counts(sid).numpy(),
                                          np.bincount(outputs[sid], minlength=V))


def test_greedy_verification_respects_min_tokens_per_position() -> None:
    """Stop id 3 is every position's argmax; the sample has 1 output token and
    ``min_tokens`` 3: positions 0 and 1 (output lengths 1, 2) must not stop, the bonus
    position (length 3) may. Drafts that propose the stop early are rejected."""
    shaping = LogitShaping(6, torch.device("cpu"))
    shaping.add(0, _request([1], stops=[3], min_tokens=3))
    shaping.accept(np.array([0]), np.array([5], np.int32))
    logits = LOGITS[:1].repeat(3, 1)                 # argmax 3, then 0
    for drafts, want in (([0, 0], [0, 0, 3]), ([3, 0], [0]), ([0, 3], [0, 0])):
        layout = _layout([2], [drafts])
        shaped = shaping.apply(logits, np.zeros(3, np.int64), layout)
        out = rejection_sample(shaped, torch.tensor([*drafts, 0]), np.array([2], np.int32),
                               np.arange(3), _params(1, 0.0, max_logprobs=1), None,
                               raw_logits=logits)
        assert out.token_ids[0, :out.counts[0]].tolist() == want, drafts
        # logprobs stay the raw model's
        raw = logits[0].double().log_softmax(-1)
        np.testing.assert_allclose(out.logprobs[0, :out.counts[0]], raw[want].numpy(),
                                   rtol=1e-5)


def test_sampled_verification_follows_the_min_tokens_masked_target() -> None:
    """Chi-square on 6 tokens: a sample with 1 output token and ``min_tokens`` 2 (stop id
    3, the raw favourite at both positions): the first verified position follows p with 3
    removed, the bonus position (output length 2) the unmasked p, whatever the draft
    proposed."""
    torch.manual_seed(0)
    n, temperature = 20000, 0.8
    shaping = LogitShaping(6, torch.device("cpu"))
    shaping.add(0, _request([1], stops=[3], min_tokens=2, n=n))
    shaping.accept(np.arange(n, dtype=np.int64), np.full(n, 5, np.int32))
    logits = LOGITS[:1].repeat(2, 1)
    masked = logits.clone()
    masked[0, 3] = float("-inf")
    p = [(row / temperature).softmax(-1).double().numpy() for row in masked]
    for draft in (0, 3):             # a likely token, and the banned stop id
        layout = _layout([1] * n, [[draft]] * n)
        rows = np.repeat(np.arange(n, dtype=np.int64), 2)
        shaped = shaping.apply(logits.repeat(n, 1), rows, layout)
        out = rejection_sample(shaped, torch.tensor([draft, 0]).repeat(n), np.ones(n, np.int32),
                               np.tile([5, 6], n), _params(n, temperature),
                               torch.Generator().manual_seed(draft))
        first = out.token_ids[:, 0]
        stat, df = _chi2(np.bincount(first, minlength=6), p[0])
        assert stat < _chi2_critical(df), (draft, stat)
        accepted = out.counts == 2
        assert accepted.mean() == pytest.approx(p[0][draft], abs=0.02)
        if accepted.sum() > 1000:
            stat, df = _chi2(np.bincount(out.token_ids[accepted, 1], minlength=6), p[1])
            assert stat < _chi2_critical(df), (draft, stat)
