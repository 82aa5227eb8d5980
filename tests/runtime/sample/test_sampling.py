"""Sampler filters against an independent numpy implementation; seeded reproducibility
across batch compositions; n parallel samples share the prompt's KV blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.runtime.llm_engine import LLMEngine
from nybble.runtime.sample.sampler import SamplingBatch, filter_logits, sample
from tests.runtime.engine_helpers import run_requests


def _batch(s: int, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, gens=None,
           vocab: int = 64) -> SamplingBatch:
    return SamplingBatch.from_tensors(torch.full((s,), temperature), torch.full((s,), top_p),
                                      torch.full((s,), top_k, dtype=torch.int64),
                                      torch.full((s,), min_p), gens or [None] * s, -1, vocab)


def _kept_numpy(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The surviving token set, computed independently in float64 numpy."""
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = set(order[:top_k].tolist()) if top_k > 0 else set(range(len(p)))
    ranked = [i for i in order if i in keep]
    q = p[ranked] / p[ranked].sum()
    cum_before, kept = 0.0, set()
    for i, qi in zip(ranked, q):
        if cum_before >= top_p:
            break
        kept.add(int(i))
        cum_before += qi
    if min_p > 0:
        pk = np.array([p[i] for i in kept])
        renorm = pk / pk.sum()
        kept = {i for i, r in zip(kept, renorm) if r >= min_p * renorm.max()}
    return kept


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (-1, 0.7, 0.0),
                                               (-1, 1.0, 0.2), (20, 0.9, 0.05)])
def test_filters_match_independent_implementation(top_k, top_p, min_p) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 64) * 3
    filtered = filter_logits(logits, _batch(6, top_k=top_k, top_p=top_p, min_p=min_p))
    for row in range(6):
        kept = set(torch.isfinite(filtered[row]).nonzero().flatten().tolist())
        assert kept == _kept_numpy(logits[row].double().numpy(), top_k, top_p, min_p)


def test_sampling_frequencies_follow_probabilities() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    draws = 4000
    for _ in range(draws):
        counts[sample(logits, _batch(1), gen).token_ids[0]] += 1
    # 5 standard deviations of a binomial: fails only for a wrong distribution.
    sd = (probs * (1 - probs) * draws).sqrt()
    assert torch.all((counts - probs * draws).abs() < 5 * sd)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 32)
    out = sample(logits, _batch(5, temperature=0.0), None)
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(DEFAULT_MODEL, max_num_seqs=16)


def _generate(engine: LLMEngine, reqs: dict[str, tuple[str, SamplingParams]]):
    return run_requests(engine, [(rid, p, params) for rid, (p, params) in reqs.items()])


def test_seeded_request_is_independent_of_batch(engine: LLMEngine) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=40)
    alone = _generate(engine, {"a": ("Once upon a time", seeded)})["a"]
    others = {f"o{i}": (p, SamplingParams(temperature=1.0, max_tokens=10 + 7 * i,
                                          seed=None if i % 2 else i))
              for i, p in enumerate(["The dog", "Tom and Sue", "Lily", "One day", "Max"])}
    crowd = _generate(engine, {**others, "b": ("Once upon a time", seeded)})["b"]
    assert crowd.outputs[0].token_ids == alone.outputs[0].token_ids
    assert crowd.outputs[0].text == alone.outputs[0].text


def test_n_samples_share_prompt_blocks(engine: LLMEngine) -> None:
    prompt = "Once upon a time there was a little girl named Lily. She loved to play outside"
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=20)
    engine.add_request("grp", prompt, params)
    first = engine.engine_core.seq_ids("grp")[0]
    engine.step()  # the whole prompt is prefilled once, then forked into 4 samples
    blocks = engine.scheduler.seq_block_ids(first)
    refs = engine.scheduler.debug_state()["ref_counts"]
    n_prompt = len(engine.requests["grp"].prompt_token_ids)
    full_blocks = n_prompt // engine.kv_spec.block_size
    assert full_blocks >= 1
    assert all(int(refs[b]) == 4 for b in blocks[:full_blocks])
    for sibling in range(first + 1, first + 4):
        assert list(engine.scheduler.seq_block_ids(sibling)[:full_blocks]) == \
            list(blocks[:full_blocks])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    outs = finals["grp"].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # samples differ
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_row_argmax_is_torch_argmax() -> None:
    """The numpy route of row_argmax answers what torch.argmax answers: first index on ties,
    a NaN as the largest, all -inf rows, strided input; other dtypes take torch's own."""
    from nybble.runtime.sample.sampler import row_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 10] = x[1, 500] = 50.0                       # a tie: the first wins
    x[2, 7] = float("nan")
    x[2, 3] = float("nan")
    x[3] = float("-inf")
    x[4, 999] = float("inf")
    x[5] = 0.0
    for t in (x, x[:, ::3], x.t().contiguous().t(), x.bfloat16(), x.double()):
        got = row_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    assert row_argmax(x).tolist()[:4] == [int(x[0].argmax()), 10, 3, 0]
    out = row_argmax(x)
    out[0] = 1                                        # writable, as the sampler assigns rows
