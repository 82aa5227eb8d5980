"""The request gate: every check, the parameter it names, the resolved defaults, and the
guarantee that the scheduler never sees a request it would refuse."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nybble.runtime.scheduler.scheduler import Scheduler

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError, KVCacheExhaustedError
from nybble.runtime.frontend.input_processor import (
    DEFAULT_NAMES,
    InputProcessor,
    ParamNames,
    RequestLimits,
)
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import sample_seed

LIMITS = RequestLimits(max_model_len=512, vocab_size=512, max_num_seqs=8, max_logprobs=20,
                       num_kv_blocks=64, block_size=16)
EOS = (2, 1)
CHAT = ParamNames(prompt="messages", max_tokens="max_completion_tokens", logprobs="top_logprobs")


@pytest.fixture(scope="module")
def gate() -> InputProcessor:
    return InputProcessor(Tokenizer.from_folder(DEFAULT_MODEL), LIMITS, EOS)


def _reject(gate: InputProcessor, prompt, params: SamplingParams,
            names: ParamNames = DEFAULT_NAMES) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        gate.process("r", prompt, params, names=names)
    return info.value


PROMPT = [1, 5, 9, 200]


@pytest.mark.parametrize("field,value,param,fragment", [
    ("n", 0, "n", "n must be an integer >= 1, got 0"),
    ("n", 9, "n", "n must be <= 8 (max_num_seqs"),
    ("temperature", -0.5, "temperature", "temperature must be a finite number >= 0"),
    ("top_k", 0.5, "top_k", "got 0.5"),
    ("temperature", math.nan, "temperature", "got nan"),
    ("temperature", math.inf, "temperature", "got inf"),
    ("top_p", 0.0, "top_p", "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p", "got 1.5"),
    ("top_p", math.nan, "top_p", "got nan"),
    ("top_k", -2, "top_k", ("top_k must be -1 or 0 (disabled) or an integer in [1, 512] (the "
                            "vocabulary), got -2")),
    ("top_k", 513, "top_k", "in [1, 512] (the vocabulary), got 513"),
    ("top_k", 2**63, "top_k", f"got {2**63}"),
    ("min_p", 1.5, "min_p", "min_p must be in [0, 1], got 1.5"),
    ("min_p", -0.1, "min_p", "got -0.1"),
    ("seed", 1 << 64, "seed", f"got {1 << 64}"),
    ("seed", -(1 << 63) - 1, "seed", "seed must be an integer in [-9223372036854775808, "),
    ("seed", 1.5, "seed", "got 1.5"),
    ("seed", -1.0, "seed", ("seed must be an integer in [-9223372036854775808, "
                            "18446744073709551615] (-1: no seed), got -1.0")),
    ("max_tokens", -1, "max_tokens", "max_tokens must be >= 0, got -1"),
    ("best_of", 0, "best_of", "best_of must be an integer >= n (1), got 0"),
    ("prompt_logprobs", 21, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
    ("logprobs", 21, "logprobs", "logprobs must be in [0, 20] (max_logprobs 20"),
    ("logprobs", -1, "logprobs", "got -1"),
    ("stop", ["ok", ""], "stop", "stop must be non-empty strings"),
    ("stop_token_ids", [3, 512], "stop_token_ids", "must hold token ids in [0, 512), got [512]"),
    ("stop_token_ids", [-1], "stop_token_ids", "got [-1]"),
])
def test_each_range_is_checked_and_named(gate: InputProcessor, field: str, value: object,
                                          param: str, fragment: str) -> None:
    err = _reject(gate, PROMPT, SamplingParams(**{field: value}))
    assert err.param == param
    assert fragment in str(err)


def test_in_range_values_pass(gate: InputProcessor) -> None:
    params = SamplingParams(n=8, temperature=0.0, top_p=1.0, top_k=512, min_p=1.0,
                            seed=(1 << 64) - 1, max_tokens=1, logprobs=20,
                            stop=["."], stop_token_ids=[0, 511])
    assert gate.process("r", PROMPT, params).params.max_tokens == 1
    assert gate.process("r", PROMPT, SamplingParams(seed=-(1 << 63))).params.seed == -(1 << 63)


def test_the_whole_seed_range_is_accepted_for_any_n(gate: InputProcessor) -> None:
    # sample i's generator is seeded (seed + i * 1_000_003) mod 2**64: it never overflows
    for seed in ((1 << 64) - 1, -(1 << 63), 0):
        assert gate.process("r", PROMPT, SamplingParams(n=8, seed=seed)).params.seed == seed
    assert [sample_seed((1 << 64) - 1, i) for i in range(3)] == \
        [(1 << 64) - 1, 1_000_002, 2_000_005]
    assert sample_seed(-5, 0) == (1 << 64) - 5   # the generator torch makes of -5 anyway


def test_seed_minus_one_means_no_seed(gate: InputProcessor) -> None:
    assert SamplingParams(seed=-1).seed is None
    assert gate.process("r", PROMPT, SamplingParams(seed=-1, n=2)).params.seed is None
    assert SamplingParams(seed=-2).seed == -2


@pytest.mark.parametrize("top_p", [1e-39, 1e-45, 5e-324])
def test_a_top_p_that_underflows_float32_is_greedy(gate: InputProcessor, top_p: float) -> None:
    params = gate.process("r", PROMPT, SamplingParams(temperature=0.8, top_p=top_p)).params
    assert params.temperature == 0.0 and params.top_p == top_p
    kept = gate.process("r", PROMPT, SamplingParams(temperature=0.8, top_p=1.2e-38)).params
    assert kept.temperature == 0.8


def test_temperature_must_fit_float32(gate: InputProcessor) -> None:
    assert gate.process("r", PROMPT, SamplingParams(temperature=3.4e38)).params.temperature \
        == 3.4e38
    err = _reject(gate, PROMPT, SamplingParams(temperature=3.5e38))
    assert err.param == "temperature" and "at most 3.402823e+38" in str(err)


def test_logprobs_capped_by_the_vocabulary(gate: InputProcessor) -> None:
    small = InputProcessor(gate.tokenizer, RequestLimits(512, 10, 8, 20, 24, 16), EOS)
    small.process("r", [1, 2], SamplingParams(logprobs=10))
    err = _reject(small, [1, 2], SamplingParams(logprobs=11))
    assert err.param == "logprobs" and "in [0, 10]" in str(err) and "vocabulary 10" in str(err)


def test_api_names_are_used_for_params(gate: InputProcessor) -> None:
    assert _reject(gate, PROMPT, SamplingParams(logprobs=25), CHAT).param == "top_logprobs"
    assert _reject(gate, PROMPT, SamplingParams(max_tokens=-1), CHAT).param == \
        "max_completion_tokens"
    assert _reject(gate, [], SamplingParams(), CHAT).param == "messages"
    assert _reject(gate, [1, 900], SamplingParams(), CHAT).param == "messages"


@pytest.mark.parametrize("prompt,fragment", [
    ("", "prompt must be non-empty, got ''"),
    ([], "prompt must be non-empty, got []"),
    ([1, 512, -3, 7], "prompt must hold token ids in [0, 512), got [512, -3]"),
])
def test_prompt_checks(gate: InputProcessor, prompt, fragment: str) -> None:
    err = _reject(gate, prompt, SamplingParams())
    assert err.param == "prompt" and fragment in str(err)


def test_over_length_is_one_message_naming_both_numbers(gate: InputProcessor) -> None:
    explicit = _reject(gate, PROMPT, SamplingParams(max_tokens=600))
    assert explicit.param == "max_tokens"
    assert str(explicit) == ("prompt + max_tokens must be <= max_model_len (512 tokens), got 4 "
                             "prompt tokens + 600 max_tokens = 604")
    chat = _reject(gate, PROMPT, SamplingParams(max_tokens=509), CHAT)
    assert chat.param == "max_completion_tokens"
    assert str(chat).startswith("messages + max_completion_tokens must be <= max_model_len "
                                "(512 tokens), got 4 prompt tokens + 509")
    # No max_tokens: the prompt alone leaves no room, so the prompt is named.
    full = _reject(gate, [1] * 512, SamplingParams(max_tokens=None))
    assert full.param == "prompt"
    assert str(full).startswith("prompt + max_tokens must be <= max_model_len (512 tokens), "
                                "got 512 prompt tokens + 1 max_tokens = 513")
    assert _reject(gate, [1] * 600, SamplingParams(max_tokens=None), CHAT).param == "messages"
    # prompt + max_tokens == max_model_len exactly is allowed
    assert gate.process("r", [1] * 500, SamplingParams(max_tokens=12)).max_tokens == 12


def test_null_max_tokens_is_the_rest_of_each_prompts_context(gate: InputProcessor) -> None:
    params = SamplingParams(max_tokens=None)
    short = gate.process("a", [1] * 10, params)
    long = gate.process("b", [1] * 300, params)
    assert (short.max_tokens, long.max_tokens) == (502, 212)
    assert params.max_tokens is None, "the caller's params are not mutated"
    text = gate.process("c", "Once upon a time", params)
    assert text.max_tokens == 512 - len(text.prompt_token_ids)


def test_kv_pool_fit(gate: InputProcessor) -> None:
    # 24 blocks x 16 tokens = 384 slots; a request needs min(prompt + max_tokens, 512) slots
    small = InputProcessor(gate.tokenizer, RequestLimits(512, 512, 8, 20, 24, 16), EOS)
    small.process("r", [1] * 100, SamplingParams(max_tokens=284))
    err = _reject(small, [1] * 100, SamplingParams(max_tokens=285))
    assert isinstance(err, KVCacheExhaustedError)
    assert err.param == "max_tokens" and "25 KV blocks" in str(err) and "24 blocks" in str(err)
    assert _reject(small, [1] * 10, SamplingParams(max_tokens=None), CHAT).param == \
        "max_completion_tokens"


def test_core_request_fields(gate: InputProcessor) -> None:
    text = gate.process("t", "Once upon a time", SamplingParams(stop_token_ids=[1, 7]),
                        arrival_time=12.5)
    assert text.prompt_token_ids == gate.tokenizer.encode("Once upon a time")
    assert text.stop_token_ids == [1, 7, 2]      # the user's ids, then the EOS ids not in them
    assert text.arrival_time == 12.5 and text.request_id == "t"
    no_eos = gate.process("u", PROMPT, SamplingParams(ignore_eos=True, stop_token_ids=[7]))
    assert no_eos.stop_token_ids == [7]


@settings(max_examples=300, deadline=None)
@given(prompt_len=st.integers(1, 80), max_tokens=st.one_of(st.none(), st.integers(1, 120)),
       n=st.integers(1, 6), num_blocks=st.integers(1, 12), block_size=st.sampled_from([8, 16]),
       max_model_len=st.integers(1, 100), max_num_seqs=st.integers(1, 6))
def test_scheduler_never_refuses_what_the_gate_accepts(gate, prompt_len, max_tokens, n,
                                                       num_blocks, block_size, max_model_len,
                                                       max_num_seqs) -> None:
    """The scheduler only asserts its input: whatever it would refuse, the gate refuses first
    (the gate is stricter still: prompt + max_tokens must fit max_model_len)."""
    limits = RequestLimits(max_model_len, 512, max_num_seqs, 20, num_blocks, block_size)
    g = InputProcessor(gate.tokenizer, limits, EOS)

    def scheduler_add(max_tok: int) -> None:
        Scheduler(num_blocks, block_size, max_num_seqs, 64, max_model_len).add(
            0, np.full(prompt_len, 3, np.int32), max_tok, np.asarray(EOS, np.int32), n)

    try:
        req = g.process("r", [3] * prompt_len, SamplingParams(n=n, max_tokens=max_tokens))
    except InvalidRequestError:
        return
    scheduler_add(req.max_tokens)  # must not raise
    resolved = max_model_len - prompt_len if max_tokens is None else max_tokens
    assert req.max_tokens == resolved and prompt_len + resolved <= max_model_len
