"""Fault injection into the in-process engine: a model forward that raises once, a sampler
that raises once, an admission that fails late. Each fails only the requests involved; the
engine is rolled back (blocks free, no sampling row, gauges 0) and then serves normal
requests with the same greedy text as a fresh engine. The offline ``LLM`` does not wedge
either (a failed step or a Ctrl-C raises to its caller, and the next call works)."""
from __future__ import annotations

import pytest

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import EngineStepError
from nybble.runtime.worker import model_runner
from nybble.runtime.llm_engine import LLMEngine
from nybble.runtime.engine.fault_injection import InjectedFault, install_faults, parse_spec
from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine

PROMPTS = ["Once upon a time", "The dog", "Lily and Tom", "One day, a little bird"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
ENGINE_ARGS = {"max_num_seqs": 2, "num_gpu_blocks": 64}   # 2 requests per step: 4 make 2 waves


@pytest.fixture(scope="module")
def fresh_texts() -> dict[str, str]:
    """Each prompt's greedy text on a fresh engine."""
    llm = LLM(DEFAULT_MODEL, **ENGINE_ARGS)
    return {p: o.outputs[0].text
            for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


@pytest.fixture()
def engine(monkeypatch: pytest.MonkeyPatch) -> LLMEngine:
    """A fresh engine; the sampler that a test may wrap is restored afterwards."""
    monkeypatch.setattr(model_runner, "sample", model_runner.sample)
    return make_engine(**ENGINE_ARGS)


def _run(engine: LLMEngine) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Step to the end; returns the finished texts and the requests of each failed step."""
    texts: dict[str, str] = {}
    failures: dict[str, list[str]] = {}
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except EngineStepError as e:
            failures[str(e)] = e.request_ids
            continue
        for out in outputs:
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return texts, failures


def _add_all(engine: LLMEngine, prefix: str, params: SamplingParams = GREEDY) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{prefix}{i}", prompt, params)


def _assert_serves_like_new(engine: LLMEngine, fresh: dict[str, str]) -> None:
    assert_idle_and_clean(engine)
    _add_all(engine, "after")
    texts, failures = _run(engine)
    assert not failures
    assert texts == {f"after{i}": fresh[p] for i, p in enumerate(PROMPTS)}
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("spec,failed", [
    ("forward@1", ["r0", "r1"]),      # the first prefill: the first wave's two requests
    ("forward@4", ["r0", "r1"]),      # a decode step of the first wave
    ("sampler@1", ["r0", "r1"]),
    ("sampler@20", ["r2", "r3"]),     # the second wave, mid-decode
])
def test_a_failed_step_fails_only_its_batch(engine: LLMEngine, fresh_texts: dict[str, str],
                                            spec: str, failed: list[str]) -> None:
    install_faults(engine.engine_core, spec)
    _add_all(engine, "r")
    texts, failures = _run(engine)
    point, call = spec.split("@")
    assert failures == {f"InjectedFault: injected {point} failure (call {call})": failed}
    others = [f"r{i}" for i in range(4) if f"r{i}" not in failed]
    assert texts == {r: fresh_texts[PROMPTS[int(r[1])]] for r in others}
    _assert_serves_like_new(engine, fresh_texts)


def test_a_failed_step_takes_every_sample_of_a_forked_request(
        engine: LLMEngine, fresh_texts: dict[str, str]) -> None:
    install_faults(engine.engine_core, "forward@3")
    engine.add_request("group", PROMPTS[0], SamplingParams(n=2, temperature=0.9, seed=5,
                                                           max_tokens=12))
    engine.step()   # prefill: the two samples fork and share the prompt's blocks
    assert engine.get_stats().num_running == 2
    engine.step()
    with pytest.raises(EngineStepError) as info:
        engine.step()
    assert info.value.request_ids == ["group"]
    assert isinstance(info.value.__cause__, InjectedFault)
    _assert_serves_like_new(engine, fresh_texts)


def test_an_admission_that_fails_late_leaves_no_trace(engine: LLMEngine,
                                                      fresh_texts: dict[str, str]) -> None:
    install_faults(engine.engine_core, "add@2")   # after the sampling rows were added
    engine.add_request("first", PROMPTS[0], GREEDY)
    with pytest.raises(InjectedFault):
        engine.add_request("second", PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=1))
    assert list(engine.requests) == ["first"] and engine.engine_core.request_ids() == ["first"]
    assert len(engine.engine_core.runner.sampling) == 1
    texts, failures = _run(engine)
    assert texts == {"first": fresh_texts[PROMPTS[0]]} and not failures
    _assert_serves_like_new(engine, fresh_texts)


def test_an_output_side_failure_at_admission_is_undone_in_the_core(
        engine: LLMEngine, fresh_texts: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("detokenizer state could not be built")

    monkeypatch.setattr(engine.output_processor, "add_request", broken)
    with pytest.raises(RuntimeError, match="detokenizer"):
        engine.add_request("x", PROMPTS[0], GREEDY)
    monkeypatch.undo()
    _assert_serves_like_new(engine, fresh_texts)


def test_offline_llm_raises_for_a_failed_step_and_stays_usable(
        fresh_texts: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner, "sample", model_runner.sample)
    llm = LLM(DEFAULT_MODEL, **ENGINE_ARGS)
    install_faults(llm.llm_engine.engine_core, "sampler@5")
    with pytest.raises(EngineStepError) as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert info.value.request_ids == ["0", "1"]
    assert_idle_and_clean(llm.llm_engine)   # the call's other requests were aborted
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [fresh_texts[p] for p in PROMPTS]
    assert_idle_and_clean(llm.llm_engine)


def test_offline_llm_survives_a_keyboard_interrupt(fresh_texts: dict[str, str]) -> None:
    llm = LLM(DEFAULT_MODEL, **ENGINE_ARGS)
    model = llm.llm_engine.engine_core.runner.model
    forward, calls = model.forward, [0]

    def interrupted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    model.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle_and_clean(llm.llm_engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [fresh_texts[p] for p in PROMPTS]


@pytest.mark.parametrize("spec", ["forward", "nope@1", "add@0", "sampler@x"])
def test_a_malformed_fault_spec_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="items must be POINT@CALL"):
        parse_spec(spec)
    assert parse_spec("forward@1, sampler@3,forward@2") == {"forward": {1, 2}, "sampler": {3}}
