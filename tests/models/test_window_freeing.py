"""Sliding windows that really slide: when every layer has a window (Mistral, Phi-3), the
scheduler frees the KV blocks that fell out of it, so sequences several times longer than the
whole KV pool run at the model's own ``max_model_len`` and still equal transformers (float32,
chunked prefill, prefix caching, preemption by recompute). A model with a full-attention layer
(Gemma 2) keeps every block, and its length is cut to the pool."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from nybble import SamplingParams
from nybble.runtime.llm_engine import LLMEngine
from tests.runtime.engine_helpers import assert_idle_and_clean, run_requests

from .hf_families import WINDOW, make_family_model, random_model, save_with_tokenizer
from .hf_reference import check_finals

TOL = 1e-4
NEW = 64
"""Greedy tokens per request: every sequence ends longer than the KV pool's 40 tokens."""


def _make(name: str, root: str) -> str:
    if name == "mistral":
        model = random_model(MistralConfig, MistralForCausalLM,
                             dict(num_key_value_heads=2, sliding_window=WINDOW,
                                  tie_word_embeddings=False), seed=0)
        return save_with_tokenizer(model, root, name)
    return make_family_model(name, root)


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def windowed(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = _make(request.param, str(tmp_path_factory.mktemp(request.param)))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _small_pool_engine(path: str) -> LLMEngine:
    # 6 blocks x 8 tokens: 5 to hand out (block 0 is the null block), 40 tokens in all;
    # a windowed sequence holds at most ceil((8 - 1 + 8) / 8) + 1 = 3 blocks at a time
    return LLMEngine.from_engine_args(path, max_num_batched_tokens=8, max_num_seqs=3,
                                      block_size=8, num_gpu_blocks=6)


def test_sequences_longer_than_the_pool_equal_transformers(windowed) -> None:
    path, hf = windowed
    engine = _small_pool_engine(path)
    core = engine.engine_core
    assert core.kv_window == WINDOW and engine.max_model_len == 256   # not cut to 40
    shared = list(range(50, 80))
    prompts = {"again": shared + [9, 10], "mid": list(range(200, 221)),
               "short": [1, 403, 407, 261, 378]}
    scored = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    run_requests(engine, [("warm", shared, SamplingParams(temperature=0.0, max_tokens=1))])
    # three sequences of up to 96 tokens, each needing up to 3 of the 5 blocks: preemption
    finals = run_requests(engine, [(k, ids, plain if k == "again" else scored)
                                   for k, ids in prompts.items()])
    sched = core.scheduler
    assert sched.num_window_freed_blocks > 0 and sched.num_preemptions > 0
    assert engine.get_stats().num_cached_tokens_total > 0
    check_finals(finals, prompts, hf, TOL, NEW, unscored=("again",))
    assert_idle_and_clean(engine)
    # the null block (0) stands for freed entries: read (masked out), never written
    for cache in core.runner.kv_caches:
        assert not cache[:, 0].any()


def test_a_request_longer_than_the_pool_is_admitted(windowed) -> None:
    """The gate counts the window's blocks, not the request's length (1,030 tokens here)."""
    path, _ = windowed
    engine = _small_pool_engine(path)
    engine.engine_core.request_limits()
    finals = run_requests(engine, [("long", list(range(3, 33)),
                                    SamplingParams(temperature=0.0, max_tokens=200,
                                                   ignore_eos=True))])
    assert len(finals["long"].outputs[0].token_ids) == 200
    assert_idle_and_clean(engine)


def test_a_full_attention_layer_keeps_every_block(tmp_path) -> None:
    """Gemma 2 alternates local and global layers: nothing is freed, and the model's length
    is cut to what the pool holds (6 blocks x 8 tokens)."""
    engine = _small_pool_engine(make_family_model("gemma2", str(tmp_path)))
    assert engine.engine_core.kv_window is None and engine.max_model_len == 48
    assert engine.engine_core.scheduler.null_block == -1


@pytest.mark.slow
def test_tp2_with_a_small_pool_equals_tp1(tmp_path) -> None:
    """Under tensor parallelism every rank applies rank 0's rule to the same pool: the model's
    length is kept, and greedy tokens past the pool's size equal one rank's."""
    from nybble import LLM

    path = _make("mistral", str(tmp_path))
    prompts = [list(range(50, 80)), list(range(200, 221)), [1, 403, 407, 261, 378]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        with LLM(model=path, tensor_parallel_size=tp, threads=1, max_num_batched_tokens=8,
                 max_num_seqs=3, block_size=8, num_gpu_blocks=6) as llm:
            assert llm.llm_engine.max_model_len == 256
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            tokens[tp] = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == NEW for t in tokens[1]) and tokens[2] == tokens[1]
