"""Request sets: seeded, within the context budget, ids inside the vocabulary."""
from __future__ import annotations

import numpy as np
import pytest

from nybble.bench.workloads import WorkloadConfig, build_requests, describe, sample_lengths


def test_mixed_lengths_fit_budget_and_are_long_tailed() -> None:
    cfg = WorkloadConfig(num_requests=2000, context_budget=512, seed=3)
    p, o = sample_lengths(cfg, np.random.default_rng(cfg.seed))
    assert (p >= 4).all() and (o >= 8).all() and (p + o <= 512).all()
    assert abs(np.median(p) - 512 / 3) < 15      # median ~ 1/3 of the budget
    assert p.mean() > np.median(p)               # right (long) tail


def test_same_seed_same_set_other_seed_other_set(tokenizer) -> None:  # type: ignore[no-untyped-def]
    a = build_requests(WorkloadConfig(num_requests=8, seed=1), tokenizer)
    b = build_requests(WorkloadConfig(num_requests=8, seed=1), tokenizer)
    c = build_requests(WorkloadConfig(num_requests=8, seed=2), tokenizer)
    assert a == b and a != c


def test_prompts_are_vocab_ids_with_bos(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = build_requests(WorkloadConfig(num_requests=16, context_budget=128), tokenizer,
                          vocab_size=300)
    for r in reqs:
        assert r.prompt_token_ids[0] == tokenizer.bos_token_id
        body = r.prompt_token_ids[1:]
        assert all(3 <= t < 300 for t in body)   # no special ids, below the model vocab
        assert r.prompt_len + r.output_len <= 128


def test_fixed_set_and_describe(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = build_requests(WorkloadConfig(kind="fixed", num_requests=5, input_len=20,
                                         output_len=7, context_budget=64), tokenizer)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(20, 7)}
    d = describe(reqs)
    assert d["total_prompt_tokens"] == 100 and d["total_output_tokens"] == 35


def test_dataset_prompts_are_cut_from_the_text(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = "Once upon a time there was a little cat. " * 20
    path = tmp_path / "text.txt"
    path.write_text(text)
    reqs = build_requests(WorkloadConfig(num_requests=4, context_budget=96, dataset=str(path)),
                          tokenizer)
    ids = set(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert all(set(r.prompt_token_ids[1:]) <= ids for r in reqs)


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="kind"):
        WorkloadConfig(kind="zipf")
    with pytest.raises(ValueError, match="input_len"):
        WorkloadConfig(kind="fixed", input_len=100, output_len=100, context_budget=128)
