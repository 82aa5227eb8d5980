"""Tensor parallelism end to end (``LLM(tensor_parallel_size=2)``, the ``mp`` executor, gloo
on loopback, one torch thread per rank): greedy tokens equal one rank's, token for token."""
from __future__ import annotations

import pytest

from nybble import LLM, SamplingParams
from nybble.bench.models import RandomLlamaShape, random_llama
from nybble.config import DEFAULT_MODEL
from tests.conftest import shared_path
from tests.distributed.tp_ranks import tiny_model

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park. They",
           "One day"]


def greedy_tokens(model: str, tp: int, max_tokens: int = 24, **kwargs) -> list[list[int]]:
    """Greedy token ids of :data:`PROMPTS` (several sequences per step: batched decode)."""
    llm = LLM(model=model, tensor_parallel_size=tp, threads=1, **kwargs)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _same(model: str, **kwargs) -> None:
    one = greedy_tokens(model, 1, **kwargs)
    two = greedy_tokens(model, 2, **kwargs)
    assert all(len(t) == 24 for t in one)
    assert two == one


@pytest.mark.slow
def test_bundled_model_tp2_greedy_equals_tp1():
    _same(DEFAULT_MODEL)


@pytest.mark.slow
def test_stories3m_tp2_greedy_equals_tp1():
    _same(shared_path("models", "stories3m"))


@pytest.mark.slow
def test_random_gqa_llama_tp2_greedy_equals_tp1(tmp_path):
    # 4 query heads over 2 KV heads: each rank holds 2 query heads and 1 KV head
    shape = RandomLlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                             max_position_embeddings=256)
    _same(random_llama(shape, root=str(tmp_path)))


@pytest.mark.slow
def test_random_qwen2_tp2_greedy_equals_tp1(tmp_path):
    # q/k/v biases split with their heads; 2 KV heads
    _same(tiny_model(str(tmp_path), "qwen2", kv_heads=2))


@pytest.mark.slow
def test_gptq_act_order_tp2_greedy_equals_tp1():
    # the exact CPU path: the fast path rounds each matmul's input to bfloat16, and a row-
    # parallel shard's float32 partial sums differ from one rank's by rounding, which can flip
    # a bf16 rounding and so a greedy token (the fast kernel: tests/kernels/test_cpu_qgemm.py)
    _same(shared_path("fixtures", "quant", "tiny-llama-gptq-4bit-g32-actorder"),
          cpu_activation_dtype="float32")


def _scored(tp: int) -> list:
    llm = LLM(model=DEFAULT_MODEL, tensor_parallel_size=tp, threads=1)
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=3,
                            prompt_logprobs=2)
    try:
        return llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow
def test_tp2_sampling_logprobs_and_prompt_logprobs_match_tp1():
    # n=2 forks the prompt's blocks (copy-on-write on every rank); prompt logprobs and
    # sampled logprobs ask rank 0's logits more than once per step
    one, two = _scored(1), _scored(2)
    for a, b in zip(one, two, strict=True):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
        assert len(a.prompt_logprobs) > 3 and len(a.outputs) == 2
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids and len(ca.logprobs) == 12
            for x, y in zip(ca.logprobs, cb.logprobs, strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


@pytest.mark.slow
def test_a_second_tp_llm_after_shutdown_works():
    """``with LLM(tensor_parallel_size=2)`` ends its workers and process group: a second one
    in the same process starts and answers the same."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(tensor_parallel_size=2, threads=1) as llm:
            outs.append(list(llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
                             .outputs[0].token_ids))
    assert outs[0] == outs[1] and len(outs[0]) == 12


@pytest.mark.slow
def test_chunked_prefill_steps_that_sample_nothing_tp2_equal_tp1():
    # 4 tokens per step: some steps only prefill a chunk and sample no row (no logits command)
    _same(DEFAULT_MODEL, max_num_batched_tokens=4)
