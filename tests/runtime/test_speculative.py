"""Speculative decoding end to end: stories3m target, with the bundled stories260k draft and
with n-gram proposals, against the same engine without speculation."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL, EngineConfig, SpeculativeConfig
from tests.conftest import shared_path

TARGET = shared_path("models", "stories3m")
DRAFT = {"model": DEFAULT_MODEL, "num_speculative_tokens": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They",
           "One day, a big bear", "Tim had a red ball. Tim had a red ball. Tim had a",
           "Once upon a time, there was a girl named Sue. Sue liked to", "The sun",
           "A cat, a cat, a cat, a cat,", "Ben wanted to play", "Mom said,",
           "Once upon a time, there was a big farm", "Once upon a time, there was a little"]
# Tight pool: 24 blocks of 8 tokens for up to 12 sequences of ~80 tokens forces preemption.
TIGHT = {"num_gpu_blocks": 24, "block_size": 8, "max_num_seqs": 12,
         "enable_prefix_caching": True}


def _greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]


@pytest.fixture(scope="module")
def baseline() -> LLM:
    return LLM(TARGET, num_gpu_blocks=256)


@pytest.fixture(scope="module", params=["draft", "ngram"])
def spec_llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(TARGET, speculative_config=DRAFT if request.param == "draft" else NGRAM,
               **TIGHT)


@pytest.mark.slow
def test_greedy_is_token_for_token_the_targets(baseline: LLM, spec_llm: LLM) -> None:
    """Batched, with preemption and prefix caching on: every token equals the
    non-speculative greedy output; max_tokens is never overshot; blocks are all freed."""
    lens = [60, 17, 45, 1, 64, 33, 2, 50, 64, 5, 40, 64]
    want = baseline.generate(PROMPTS, _greedy(lens), use_tqdm=False)
    got = spec_llm.generate(PROMPTS, _greedy(lens), use_tqdm=False)
    for w, g, n in zip(want, got, lens):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) <= n
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    core = spec_llm.llm_engine.engine_core
    stats = core.get_stats()
    assert stats.num_preemptions > 0 and stats.num_cached_tokens_total > 0
    spec = stats.spec_decode
    assert spec.num_drafts > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[-1]
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    state = core.scheduler.debug_state()
    assert not state["seqs"] and int(np.count_nonzero(state["ref_counts"])) == 0


@pytest.mark.slow
def test_stop_strings_logprobs_and_n(baseline: LLM, spec_llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=48, stop=["."], logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, n=2, stop=[" the"])]
    want = baseline.generate(PROMPTS[:2], params, use_tqdm=False)
    got = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for w, g in zip(want, got):
        assert len(g.outputs) == len(w.outputs)
        for wo, go in zip(w.outputs, g.outputs):
            assert (go.text, go.token_ids, go.finish_reason, go.stop_reason) == \
                (wo.text, wo.token_ids, wo.finish_reason, wo.stop_reason)
    for wl, gl in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert list(gl) == list(wl)
        np.testing.assert_allclose([gl[t] for t in gl], [wl[t] for t in wl], atol=1e-4)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(spec_llm: LLM) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=s, n=2)
              for s in (3, 4)]
    first = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    again = spec_llm.generate(PROMPTS[:2] + PROMPTS[5:7], params + _greedy([20, 20]),
                              use_tqdm=False)
    for a, b in zip(first, again):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert all(len(o.token_ids) <= 40 for o in a.outputs)


def test_config_is_validated_with_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"keys must be among \('method'"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "draft": "x"})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an int in \[1, 16\]"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min must be <= prompt_lookup_max"):
        SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 2,
                                     "prompt_lookup_min": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        SpeculativeConfig.from_dict("{nope")
    cfg = EngineConfig.from_kwargs(speculative_config=json.dumps(DRAFT))
    assert cfg.speculative_config == SpeculativeConfig("draft_model", DEFAULT_MODEL, 4)
    # a draft with another vocabulary, then another tokenizer, is refused at start-up
    draft = tmp_path / "draft"
    shutil.copytree(DEFAULT_MODEL, draft)
    conf = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**conf, "vocab_size": 1024}))
    with pytest.raises(ValueError, match=r"vocab_size must be the target's \(512\), got 1024"):
        LLM(TARGET, speculative_config={"model": str(draft)})
    (draft / "config.json").write_text(json.dumps(conf))
    tok = draft / "tokenizer.json"
    if tok.exists():
        tok.write_text(tok.read_text().replace('"<unk>"', '"<UNK>"', 1))
        with pytest.raises(ValueError, match="share one tokenizer"):
            LLM(TARGET, speculative_config={"model": str(draft)})


def test_cli_flag_builds_the_config() -> None:
    import argparse

    from nybble.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    spec = engine_config_from_args(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.lookup_max, spec.lookup_min) == \
        ("ngram", 3, 3, 1)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None
    assert os.path.isdir(TARGET)


def test_stats_log_line_reports_the_interval_acceptance(caplog) -> None:
    import logging
    from types import SimpleNamespace

    from nybble.runtime.frontend.async_engine import AsyncEngine
    from nybble.runtime.messages import SpecDecodeStats
    host = SimpleNamespace(_spec_seen=SpecDecodeStats(2, 6, 3, [2, 1, 0]))
    with caplog.at_level(logging.INFO, logger="nybble.runtime.frontend.async_engine"):
        AsyncEngine._log_spec_decode(host, SpecDecodeStats(6, 18, 12, [6, 4, 2]))
    # the interval: 4 drafts, 12 drafted, 9 accepted -> 75%, 1 + 9 / 4 tokens per draft
    assert ("speculative decoding: acceptance rate 75.0%, mean acceptance length 3.25 tokens, "
            "drafted 12 tokens, accepted 9 tokens") in caplog.text


def test_a_failed_speculative_step_rolls_back_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A verification that raises fails only its batch's requests; blocks, sampling rows
    and the draft's bookkeeping are all released, and the engine goes on."""
    from nybble.errors import EngineStepError
    from nybble.runtime.worker import model_runner
    from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine

    engine = make_engine(max_num_seqs=2, num_gpu_blocks=64,
                         speculative_config={"model": DEFAULT_MODEL, "num_speculative_tokens": 3})
    real, calls = model_runner.rejection_sample, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "rejection_sample", flaky)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=20))
    failed, done = [], {}
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineStepError as e:
            failed += e.request_ids
            continue
        done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    assert len(failed) == 2 and set(done) == {"0", "1", "2", "3"} - set(failed)
    assert all(len(t) == 20 for t in done.values())
    assert_idle_and_clean(engine)
    assert not engine.engine_core.runner.proposer.lagging


def test_draft_equal_to_target_accepts_everything() -> None:
    """The bundled model drafting for itself: every proposal is accepted (the acceptance
    counters are exact), and the output is the model's own greedy output."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(DEFAULT_MODEL, num_gpu_blocks=64).generate(PROMPTS[:3], params, use_tqdm=False)
    llm = LLM(DEFAULT_MODEL, num_gpu_blocks=64,
              speculative_config={"model": DEFAULT_MODEL, "num_speculative_tokens": 3})
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    spec = llm.llm_engine.engine_core.get_stats().spec_decode
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    assert spec.accepted_per_pos == [spec.num_drafts] * 3
