"""Logit shaping through the engine on the bundled model, against independent references:
transformers' ``generate(repetition_penalty=...)``, and a greedy loop over transformers'
logits shaped by the formulas (``shaping_reference``); ``min_tokens`` exact to the token;
per-row counts that survive preemption by recompute and leave nothing behind after a failed
step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import EngineStepError
from nybble.runtime.worker import model_runner
from nybble.runtime.engine.fault_injection import install_faults
from nybble.runtime.frontend.shaping_checks import bad_words_token_ids
from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine
from tests.runtime.shaping_reference import reference
from tests.runtime.test_engine_hf_parity import STORY_PROMPTS, _hf_model

EOS = 2   # the bundled model's EOS id


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEFAULT_MODEL, max_num_seqs=16)


@pytest.fixture(scope="module")
def tok() -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def hf_shaped_greedy(prompt_ids: list[int], p: SamplingParams,
                     bad_words: list[list[int]] = ()) -> list[int]:
    """Greedy decoding over transformers' logits shaped by the reference formulas; stops
    after an EOS (unless ``ignore_eos``) or ``max_tokens``."""
    model = _hf_model(DEFAULT_MODEL)
    stops = [EOS] if not p.ignore_eos else []
    stops += p.stop_token_ids or []
    out: list[int] = []
    with torch.no_grad():
        while len(out) < (p.max_tokens or 0):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].numpy()
            shaped = reference(logits, p, prompt_ids, out, stops, bad_words)
            out.append(int(np.argmax(shaped)))
            if out[-1] in stops:
                break
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_greedy_repetition_penalty_equals_transformers_generate(llm: LLM, tok: AutoTokenizer,
                                                                penalty: float) -> None:
    prompts = STORY_PROMPTS[:6]
    params = SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=penalty)
    outs = llm.generate(prompts, params, use_tqdm=False)
    model = _hf_model(DEFAULT_MODEL)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt).input_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48,
                                 repetition_penalty=penalty, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


SHAPES = {
    "logit_bias": dict(logit_bias={262: 4.0, 278: -100.0, 13: 2.5}),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.9),
    "openai_mix": dict(presence_penalty=-0.5, frequency_penalty=1.2, logit_bias={300: 1.0}),
    "allowed": dict(allowed_token_ids=[2, 13, 262, 278, 300, 301, 350, 400, 450, 500]),
    "everything": dict(repetition_penalty=1.15, frequency_penalty=0.4, logit_bias={262: 1.0},
                       min_tokens=20, bad_words=["the", "was"]),
}


def test_greedy_shaping_matches_the_formulas_in_a_mixed_batch(llm: LLM,
                                                              tok: AutoTokenizer) -> None:
    """Every feature, batched together with an unshaped request, equals the reference loop
    token for token."""
    prompt = "Once upon a time"
    params = [SamplingParams(temperature=0.0, max_tokens=40, **kw) for kw in SHAPES.values()]
    params.append(SamplingParams(temperature=0.0, max_tokens=40))
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    ids = tok(prompt).input_ids
    gate = llm.llm_engine.input_processor.tokenizer
    for name, p, out in zip([*SHAPES, "plain"], params, outs):
        bad = bad_words_token_ids(gate, p.bad_words or [])
        assert out.outputs[0].token_ids == hf_shaped_greedy(ids, p, bad), name
    plain = outs[-1].outputs[0].token_ids
    assert all(o.outputs[0].token_ids != plain for o in outs[:-1]), "a shape changed nothing"


def test_bad_words_never_appear(llm: LLM, tok: AutoTokenizer) -> None:
    plain = llm.generate(STORY_PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=40),
                         use_tqdm=False)
    words = ["the", "Tim", "said", "play"]
    shaped = llm.generate(STORY_PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=40,
                                                            bad_words=words), use_tqdm=False)
    banned = bad_words_token_ids(llm.llm_engine.input_processor.tokenizer, words)
    hits = 0
    for before, after in zip(plain, shaped):
        for word in banned:
            k = len(word)
            seqs = before.outputs[0].token_ids, after.outputs[0].token_ids
            found = [any(s[i:i + k] == word for i in range(len(s))) for s in seqs]
            hits += found[0]
            assert not found[1], (word, after.outputs[0].text)
    assert hits, "the plain outputs never used a bad word: the test proves nothing"


@pytest.mark.parametrize("k", [0, 1, 5])
def test_min_tokens_blocks_a_forced_stop_token_until_reached(llm: LLM, k: int) -> None:
    """``logit_bias`` makes token 262 the argmax at every step and 262 is a stop id: the
    output is exactly ``k + 1`` tokens, 262 last and nowhere before."""
    p = SamplingParams(temperature=0.0, max_tokens=30, logit_bias={262: 100.0},
                       stop_token_ids=[262], min_tokens=k)
    out = llm.generate(["The dog"], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k + 1 and out.token_ids[-1] == 262
    assert 262 not in out.token_ids[:-1]
    assert out.finish_reason == "stop" and out.stop_reason == 262


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_blocks_eos(llm: LLM, k: int) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=30, logit_bias={EOS: 100.0}, min_tokens=k)
    out = llm.generate(["The dog"], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k + 1 and out.token_ids[-1] == EOS
    assert EOS not in out.token_ids[:-1] and out.finish_reason == "stop"


@pytest.mark.parametrize("k", [0, 2, 4])
def test_min_tokens_holds_stop_strings_back(llm: LLM, tok: AutoTokenizer, k: int) -> None:
    """Every token is forced to 262; its text is the stop string: a stop string only ends
    the output at token ``k + 1``, and the text before it stays."""
    piece = tok.decode([450, 262])[len(tok.decode([450])):]   # 262's text after a word
    p = SamplingParams(temperature=0.0, max_tokens=30, logit_bias={262: 100.0}, min_tokens=k,
                       stop=[piece])
    out = llm.generate(["The dog"], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k + 1, (piece, out.text)
    assert out.finish_reason == "stop" and out.stop_reason == piece
    assert out.text == piece * k


def _penalized(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=60, frequency_penalty=0.5 + i / 10,
                           repetition_penalty=1.1, presence_penalty=0.3) for i in range(n)]


def test_counts_survive_preemption_by_recompute() -> None:
    prompts = STORY_PROMPTS[:6]
    roomy = LLM(DEFAULT_MODEL, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in
            roomy.generate(prompts, _penalized(6), use_tqdm=False)]
    tight = LLM(DEFAULT_MODEL, max_num_seqs=8, num_gpu_blocks=12, block_size=16)
    got = [o.outputs[0].token_ids for o in
           tight.generate(prompts, _penalized(6), use_tqdm=False)]
    assert tight.llm_engine.get_stats().num_preemptions > 0, "no preemption happened"
    assert got == want
    assert_idle_and_clean(tight.llm_engine)


def test_a_failed_step_frees_the_rows_and_the_next_requests_start_clean(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner, "sample", model_runner.sample)
    engine = make_engine(max_num_seqs=4, num_gpu_blocks=64)
    fresh = make_engine(max_num_seqs=4, num_gpu_blocks=64)
    install_faults(engine.engine_core, "sampler@6")
    prompts = STORY_PROMPTS[:3]
    params = _penalized(3)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"a{i}", prompt, p)
        fresh.add_request(f"a{i}", prompt, p)
    failed = []
    while engine.has_unfinished_requests():
        try:
            engine.step()
        except EngineStepError as e:
            failed += e.request_ids
    assert sorted(failed) == ["a0", "a1", "a2"]
    assert_idle_and_clean(engine)
    assert len(engine.engine_core.runner.shaping) == 0

    def run(e: object) -> list[list[int]]:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            e.add_request(f"b{i}", prompt, p)   # type: ignore[attr-defined]
        done = {}
        while e.has_unfinished_requests():   # type: ignore[attr-defined]
            for out in e.step():   # type: ignore[attr-defined]
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return [done[f"b{i}"] for i in range(3)]

    while fresh.has_unfinished_requests():
        fresh.step()
    assert run(engine) == run(fresh)


def test_unshaped_requests_never_touch_the_shaping_state(llm: LLM,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.llm_engine.engine_core.runner

    def boom(*args: object) -> None:
        raise AssertionError("shaping ran for an unshaped batch")

    monkeypatch.setattr(runner.shaping, "apply", boom)
    monkeypatch.setattr(runner.shaping, "accept", boom)
    outs = llm.generate(STORY_PROMPTS[:3], SamplingParams(temperature=0.7, seed=1,
                                                          max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) for o in outs)
    assert llm.llm_engine.engine_core.grammars._compiler is None


def test_sampled_rows_keep_to_allowed_ids_and_logprobs_stay_raw(llm: LLM) -> None:
    allowed = [13, 262, 278, 300, 350]
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=20, allowed_token_ids=allowed,
                       logprobs=0, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=20, logprobs=0, ignore_eos=True)
    out, ref = llm.generate(["The dog", "The dog"], [p, plain], use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert set(tokens) <= set(allowed)
    # logprobs are the model's (raw): the same value the unshaped request reports for the
    # first token's position whenever both picked the same token there
    first = out.outputs[0].logprobs[0]
    assert first[tokens[0]] < 0
    lp = ref.outputs[0].logprobs[0]
    if ref.outputs[0].token_ids[0] == tokens[0]:
        assert lp[tokens[0]] == pytest.approx(first[tokens[0]], abs=1e-5)
