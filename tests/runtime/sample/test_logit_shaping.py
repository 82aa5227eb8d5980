"""LogitShaping against references written here from the formulas (OpenAI's API reference
for logit_bias and the presence/frequency penalties, transformers' and vLLM's repetition
penalty, vLLM's bad_words, allowed_token_ids and min_tokens rules), row by row in numpy
float32, for a batch that mixes shaped and unshaped rows; and its row bookkeeping."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.runtime.sample.logit_shaping import LogitShaping
from nybble.runtime.messages import EngineCoreRequest
from nybble.sampling_params import SamplingParams
from tests.runtime.shaping_reference import reference as _reference

V = 64


def reference(logits: np.ndarray, req: EngineCoreRequest, output: list[int]) -> np.ndarray:
    return _reference(logits, req.params, req.prompt_token_ids, output, req.stop_token_ids,
                      req.bad_words_token_ids)


def _request(prompt: list[int], stops: list[int] = (), bad: list[list[int]] = (),
             **kw: object) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=50, **kw)   # type: ignore[arg-type]
    return EngineCoreRequest("r", list(prompt), params, list(stops), 0.0,
                             bad_words_token_ids=[list(b) for b in bad])


CASES = [
    _request([1, 2, 3], logit_bias={5: 7.5, 9: -100.0, 2: 0.25}),
    _request([4, 4, 8], repetition_penalty=1.7),
    _request([3, 9], repetition_penalty=0.6, presence_penalty=0.5, frequency_penalty=-0.7),
    _request([1], presence_penalty=1.5, frequency_penalty=2.0),
    _request([7], stops=[0, 11], min_tokens=3),
    _request([2], allowed_token_ids=[3, 5, 8, 13, 21], logit_bias={5: -2.0}),
    _request([5], bad=[[12], [20, 21], [30, 31, 32]]),
    _request([6, 6], logit_bias={1: 3.0}, repetition_penalty=1.2, min_tokens=2, stops=[0],
             bad=[[40, 41]], frequency_penalty=0.3),
]


def test_every_feature_matches_its_formula_step_by_step() -> None:
    torch.manual_seed(0)
    shaping = LogitShaping(V, torch.device("cpu"), capacity=2)   # grows while adding
    # rows: an unshaped sequence (id 100) between shaped ones
    seq_ids = []
    for i, req in enumerate(CASES):
        shaping.add(10 * i, req)
        seq_ids.append(10 * i)
    seq_ids.insert(3, 100)
    ids = np.array(seq_ids, np.int64)
    outputs: dict[int, list[int]] = {s: [] for s in seq_ids}
    gen = np.random.default_rng(0)
    for step in range(6):
        logits = torch.randn(len(ids), V) * 4
        shaped = shaping.apply(logits, ids)
        for row, sid in enumerate(seq_ids):
            if sid == 100:
                assert torch.equal(shaped[row], logits[row])
                continue
            want = reference(logits[row].numpy(), CASES[sid // 10], outputs[sid])
            np.testing.assert_array_equal(shaped[row].numpy(), want,
                                          err_msg=f"case {sid // 10} step {step}")
        # feed tokens that exercise the counts, the bad-word prefixes and repeats
        tokens = gen.integers(0, V, len(ids)).astype(np.int32)
        for row, sid in enumerate(seq_ids):
            if sid == 60:
                tokens[row] = [20, 30, 31, 30, 31, 20][step]
            if sid == 70:
                tokens[row] = [40, 6, 40, 40, 1, 1][step]
            outputs[sid].append(int(tokens[row]))
        assert shaping.accept(ids, tokens) == []
    for sid in seq_ids:
        if sid != 100 and CASES[sid // 10].params.penalized:
            want = np.bincount(outputs[sid], minlength=V)
            np.testing.assert_array_equal(shaping.counts(sid).numpy(), want)
            assert shaping.output_len(sid) == 6


def test_no_shaping_no_rows_and_logits_untouched() -> None:
    shaping = LogitShaping(V, torch.device("cpu"))
    shaping.add(0, _request([1, 2], n=2))
    assert len(shaping) == 0
    logits = torch.randn(1, V)
    assert shaping.apply(logits, np.array([0])) is logits
    assert shaping.accept(np.array([0]), np.array([3], np.int32)) == []


def test_a_freed_row_carries_nothing_over() -> None:
    shaping = LogitShaping(V, torch.device("cpu"), capacity=1)
    shaping.add(0, _request([1, 2], frequency_penalty=1.0, logit_bias={3: 5.0}))
    shaping.accept(np.array([0]), np.array([9], np.int32))
    assert int(shaping.counts(0)[9]) == 1
    shaping.remove([0])
    assert len(shaping) == 0
    req = _request([4], frequency_penalty=1.0)
    shaping.add(1, req)    # reuses the row
    assert int(shaping.counts(1).sum()) == 0 and shaping.output_len(1) == 0
    logits = torch.zeros(1, V)
    np.testing.assert_array_equal(shaping.apply(logits, np.array([1]))[0].numpy(),
                                  reference(np.zeros(V, np.float32), req, []))


def test_n_samples_get_their_own_rows() -> None:
    shaping = LogitShaping(V, torch.device("cpu"))
    shaping.add(5, _request([1], n=3, presence_penalty=1.0))
    assert len(shaping) == 3 and all(s in shaping for s in (5, 6, 7))
    shaping.accept(np.array([5, 6, 7]), np.array([2, 3, 2], np.int32))
    assert shaping.counts(6)[3] == 1 and shaping.counts(5)[3] == 0
    with pytest.raises(ValueError, match="must be new"):
        shaping.add(7, _request([1], presence_penalty=1.0))
    shaping.remove([5, 6, 7, 99])
    assert len(shaping) == 0
