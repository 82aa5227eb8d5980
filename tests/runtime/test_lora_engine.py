"""Multi-LoRA serving offline: one mixed batch of base and adapter requests gives what
transformers + PEFT give for each alone (greedy tokens and top-5 logprobs, float32), on the
bundled model and on stories3m; requests wait for a device slot instead of failing; the
prefix cache never shares KV across adapters."""
from __future__ import annotations

import pytest
import torch
from nybble import LLM, LoRARequest, SamplingParams
from nybble.config import DEFAULT_MODEL

from tests.conftest import shared_path
from tests.lora.adapters import PeftOracle, check_against_peft, make_adapter

pytestmark = pytest.mark.slow
PROMPTS = ["Once upon a time", "Tom and Sue went to the park", "The little dog",
           "Lily had a red ball"]
STEPS = 8


def _adapters(base: str, folder) -> tuple[str, str]:
    """Rank 8 (alpha 16; down_proj rank 4 and q_proj alpha 3 by pattern) and rank 16 rsLoRA
    (alpha 8) on every projection."""
    a = make_adapter(base, str(folder / "a"), r=8, alpha=16, seed=1,
                     rank_pattern={"down_proj": 4}, alpha_pattern={"q_proj": 3})
    b = make_adapter(base, str(folder / "b"), r=16, alpha=8, seed=2, use_rslora=True)
    return a, b


@pytest.fixture(scope="module", params=["stories260k", "stories3m"])
def setup(request, tmp_path_factory):
    base = DEFAULT_MODEL if request.param == "stories260k" else \
        shared_path("models", "stories3m")
    a, b = _adapters(base, tmp_path_factory.mktemp(request.param))
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32")
    yield base, llm, LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    llm.shutdown()


def test_a_mixed_batch_equals_transformers_peft(setup) -> None:
    base, llm, a, b = setup
    loras = [None, a, b, a]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    check_against_peft(base, outs, loras)
    # the adapters change the outputs (the comparison above is not of the base model thrice)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3


def test_requests_wait_for_a_slot_and_steps_hold_at_most_max_loras_adapters(tmp_path) -> None:
    a, b = _adapters(DEFAULT_MODEL, tmp_path)
    loras = [LoRARequest("a", 1, a), LoRARequest("b", 2, b), None, LoRARequest("a", 1, a)]
    with LLM(DEFAULT_MODEL, enable_lora=True, max_loras=1, max_lora_rank=16) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
        for i, (prompt, lora) in enumerate(zip(PROMPTS, loras)):
            engine.add_request(str(i), prompt, params, lora_request=lora)
        admission = engine.engine_core.lora
        assert list(admission.waiting) == ["1"]          # b waits: a holds the one slot
        finished, seen_waiting = {}, False
        while engine.has_unfinished_requests():
            running, waiting = admission.counts()
            assert len(running) <= 1
            seen_waiting |= bool(waiting)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert seen_waiting and not admission.waiting and not admission.slot_of
        check_against_peft(DEFAULT_MODEL, [finished[str(i)] for i in range(4)], loras)


def test_prefix_cache_blocks_are_never_shared_across_adapters(tmp_path) -> None:
    a, b = _adapters(DEFAULT_MODEL, tmp_path)
    prompt = " ".join(["Once upon a time there was a little girl named Lily."] * 3)
    la, lb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    with LLM(DEFAULT_MODEL, enable_lora=True, max_loras=2, max_lora_rank=16,
             block_size=8) as llm:
        order = [None, la, lb, la]
        outs = [llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
                for lora in order]
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 0, 0]   # other roots: no hit
    assert outs[3].num_cached_tokens > 0                          # same adapter: hit
    check_against_peft(DEFAULT_MODEL, outs, order)


def test_lora_requests_without_enable_lora_or_with_beam_search_are_refused(tmp_path) -> None:
    from nybble.errors import InvalidRequestError

    a = make_adapter(DEFAULT_MODEL, str(tmp_path / "a"), r=4, alpha=8, seed=3)
    with LLM(DEFAULT_MODEL) as llm:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=LoRARequest("a", 1, a))
    with LLM(DEFAULT_MODEL, enable_lora=True) as llm:
        with pytest.raises(InvalidRequestError, match="beam search"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, n=2, use_beam_search=True),
                         use_tqdm=False, lora_request=LoRARequest("a", 1, a))


def test_the_fused_cpu_step_runs_base_and_adapter_steps(tmp_path) -> None:
    a = make_adapter(DEFAULT_MODEL, str(tmp_path / "a"), r=8, alpha=16, seed=1)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    lora = LoRARequest("a", 1, a)
    with LLM(DEFAULT_MODEL) as plain:
        base = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    with LLM(DEFAULT_MODEL, enable_lora=True, enforce_eager=True) as eager:
        torch_path = eager.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=lora)
        assert eager.llm_engine.engine_core.runner.model.fused_decode is None
    with LLM(DEFAULT_MODEL, enable_lora=True) as llm:
        model = llm.llm_engine.engine_core.runner.model
        fused = model.fused_decode
        assert fused is not None and fused.lora is model.lora   # built with the slots
        calls: list[bool] = []

        class Counted:
            lora = fused.lora

            def __call__(self, *args):
                calls.append(model.lora.rows is not None)
                return fused(*args)
        model.fused_decode = Counted()
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert calls and not any(calls)               # base steps: no adapter rows
        fused_lora = llm.generate(PROMPTS[:2], params, use_tqdm=False, lora_request=lora)
        assert any(calls)                             # adapter steps ran fused too
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    for f, t in zip(fused_lora, torch_path):          # C step == torch path, to rounding
        assert f.outputs[0].token_ids == t.outputs[0].token_ids
        for fs, ts in zip(f.outputs[0].logprobs, t.outputs[0].logprobs):
            assert all(abs(fs[k] - ts[k]) < 1e-4 for k in fs.keys() & ts.keys())


def test_a_bad_adapter_fails_its_request_and_the_engine_goes_on(tmp_path) -> None:
    from nybble.errors import LoRAAdapterError

    dora = make_adapter(DEFAULT_MODEL, str(tmp_path / "dora"), r=4, alpha=8, seed=5,
                        use_dora=True)
    with LLM(DEFAULT_MODEL, enable_lora=True) as llm:
        with pytest.raises(LoRAAdapterError, match="DoRA"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=LoRARequest("dora", 1, dora))
        assert not llm.llm_engine.engine_core.has_unfinished_requests()
        out = llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2


def test_parallel_samples_of_an_adapter_request_all_run_under_it(tmp_path) -> None:
    a = make_adapter(DEFAULT_MODEL, str(tmp_path / "a"), r=8, alpha=16, seed=1)
    lora = LoRARequest("a", 1, a)
    with LLM(DEFAULT_MODEL, enable_lora=True) as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0, max_tokens=STEPS,
                                                        ignore_eos=True),
                           use_tqdm=False, lora_request=lora)[0]
        tokens, _ = PeftOracle(DEFAULT_MODEL, a).greedy(list(out.prompt_token_ids), STEPS)
        assert [list(o.token_ids) for o in out.outputs] == [tokens] * 3
        assert not llm.llm_engine.engine_core.lora.slot_of      # the pin went at the end


def test_chunked_prefill_and_preemption_keep_each_rows_adapter(tmp_path) -> None:
    a, b = _adapters(DEFAULT_MODEL, tmp_path)
    loras = [LoRARequest("a", 1, a), LoRARequest("b", 2, b), None, LoRARequest("a", 1, a)]
    prompts = [p + " and they played all day long in the sun" for p in PROMPTS]
    steps = 24
    with LLM(DEFAULT_MODEL, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=8,
             num_gpu_blocks=12, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps,
                                                    ignore_eos=True),
                            use_tqdm=False, lora_request=loras)
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for out, lora in zip(outs, loras):
        oracle = PeftOracle(DEFAULT_MODEL, None if lora is None else lora.lora_path)
        tokens, _ = oracle.greedy(list(out.prompt_token_ids), steps)
        assert list(out.outputs[0].token_ids) == tokens


def test_chat_takes_a_lora_request_too(tmp_path) -> None:
    a = make_adapter(DEFAULT_MODEL, str(tmp_path / "a"), r=8, alpha=16, seed=1)
    conversation = [{"role": "user", "content": "Tom found a red ball."}]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    with LLM(DEFAULT_MODEL, enable_lora=True) as llm:
        chat = llm.chat(conversation, params, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, a))[0]
        plain = llm.generate([chat.prompt_token_ids], params, use_tqdm=False,
                             lora_request=LoRARequest("a", 1, a))[0]
        base = llm.chat(conversation, params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.outputs[0].token_ids != base.outputs[0].token_ids


@pytest.mark.gpu
def test_a_mixed_batch_on_cuda_equals_transformers_peft(tmp_path) -> None:
    """The Triton shrink/expand kernels in the engine (CUDA graphs on for base-only steps):
    base + two adapters in one batch give transformers + PEFT's tokens and logprobs."""
    a, b = _adapters(DEFAULT_MODEL, tmp_path)
    loras = [None, LoRARequest("a", 1, a), LoRARequest("b", 2, b), LoRARequest("a", 1, a)]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    with LLM(DEFAULT_MODEL, device="cuda", enable_lora=True, max_loras=2, max_lora_rank=16,
             dtype="float32") as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    check_against_peft(DEFAULT_MODEL, outs, loras)
