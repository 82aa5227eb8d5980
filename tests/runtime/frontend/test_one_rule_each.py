"""The KV-fit rule (:func:`check_kv_fit`) and the ``min_tokens`` rule (:func:`check_min_tokens`)
are each written once: the gate and the scheduler refuse by the same function, at the same
boundary, with the same wording."""
from __future__ import annotations

import numpy as np
import pytest

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError, KVCacheExhaustedError
from nybble.runtime.frontend.input_processor import InputProcessor, ParamNames, RequestLimits
from nybble.runtime.frontend.shaping_checks import check_min_tokens
from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler
from nybble.runtime.scheduler.scheduler import Scheduler
from nybble.runtime.scheduler.scheduler_input import check_kv_fit, pool_tokens, window_blocks
from nybble.tokenizer.tokenizer import Tokenizer

CHAT = ParamNames(prompt="messages", max_tokens="max_completion_tokens", logprobs="top_logprobs")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(DEFAULT_MODEL)


def test_kv_fit_boundary_and_message() -> None:
    # 4 blocks x 4 tokens: 16 tokens fit, 17 do not; the total is capped at max_model_len
    assert check_kv_fit(10, 6, 64, 4, 4) == 16
    assert check_kv_fit(10, 100, 16, 4, 4) == 16
    with pytest.raises(KVCacheExhaustedError) as e:
        check_kv_fit(10, 7, 64, 4, 4, subject="request 3", max_tokens_name="max_new")
    assert str(e.value) == ("request 3 needs 5 KV blocks (min(prompt 10 + max_new 7, "
                            "max_model_len 64) = 17 tokens at 4 per block), but the KV cache "
                            "holds only 4 blocks")
    assert e.value.param == "max_new"
    # beams advance together: each needs its own blocks
    assert check_kv_fit(4, 4, 64, 4, 4, num_sequences=2) == 8
    with pytest.raises(KVCacheExhaustedError, match=r"^the request needs 6 KV blocks \(3 beams x"):
        check_kv_fit(4, 4, 64, 4, 4, num_sequences=3)


def test_kv_fit_with_a_sliding_window() -> None:
    # window 8, 8 tokens per step, 4 per block: a step reads positions q0 - 7 .. q0 + 7, 15
    # positions over at most ceil(15 / 4) + 1 = 5 blocks, however long the sequence grows
    assert window_blocks(8, 8, 4) == 5
    assert window_blocks(1, 1, 1) == 2 and window_blocks(4, 1, 4) == 2
    # any length once 5 blocks fit beside the null block; else what the other blocks hold
    assert pool_tokens(6, 4, 8, 8) is None and pool_tokens(5, 4, 8, 8) == 16
    assert pool_tokens(6, 4) == 24
    assert check_kv_fit(30, 1000, 4096, 4, 6, sliding_window=8, max_num_batched_tokens=8) == 1030
    # shorter than the window's blocks: its own blocks, out of the pool less the null block
    assert check_kv_fit(10, 10, 4096, 4, 6, sliding_window=8, max_num_batched_tokens=8) == 20
    with pytest.raises(KVCacheExhaustedError) as e:
        check_kv_fit(30, 1000, 4096, 4, 5, sliding_window=8, max_num_batched_tokens=8)
    assert str(e.value) == (
        "the request needs 5 KV blocks (min(prompt 30 + max_tokens 1000, max_model_len 4096) "
        "= 1030 tokens at 4 per block for a sliding window of 8 tokens: ceil((window - 1 + "
        "max_num_batched_tokens 8) / 4) + 1 = 5 blocks at a time (one more is the null block "
        "of sliding windows)), but the KV cache holds only 4 blocks")
    with pytest.raises(KVCacheExhaustedError, match=r"needs 5 KV blocks .* 20 tokens at 4 per "
                       r"block \(one more is the null block .* holds only 4 blocks"):
        check_kv_fit(10, 10, 4096, 4, 5, sliding_window=8, max_num_batched_tokens=8)


@pytest.mark.parametrize("impl", [Scheduler, ReferenceScheduler])
def test_gate_and_scheduler_agree_with_a_sliding_window(tok: Tokenizer, impl: type) -> None:
    """The window's bound, not the sequence's length: a 1,030-token request fits 6 blocks of
    4 tokens; 5 blocks do not hold the window's 5 beside the null block."""
    prompt = np.arange(3, 33, dtype=np.int32)
    for blocks, fits in ((6, True), (5, False)):
        gate = InputProcessor(tok, RequestLimits(4096, 512, 8, 20, blocks, 4, sliding_window=8,
                                                 max_num_batched_tokens=8), (2,))
        sched = impl(blocks, 4, 8, 8, 4096, sliding_window=8)
        if fits:
            gate.process("ok", prompt.tolist(), SamplingParams(max_tokens=1000))
            sched.add(0, prompt, 1000)
            continue
        with pytest.raises(KVCacheExhaustedError) as at_gate:
            gate.process("no", prompt.tolist(), SamplingParams(max_tokens=1000))
        with pytest.raises(KVCacheExhaustedError) as at_scheduler:
            sched.add(1, prompt, 1000)
        assert str(at_gate.value) == "the request" + str(at_scheduler.value).removeprefix(
            "request 1")


@pytest.mark.parametrize("impl", [Scheduler, ReferenceScheduler])
def test_gate_and_scheduler_refuse_at_the_same_boundary(tok: Tokenizer, impl: type) -> None:
    gate = InputProcessor(tok, RequestLimits(64, 512, 8, 20, 4, 4), (2,))
    sched = impl(4, 4, 8, 64, 64)
    prompt = np.arange(3, 13, dtype=np.int32)
    gate.process("ok", prompt.tolist(), SamplingParams(max_tokens=6))
    sched.add(0, prompt, 6)
    with pytest.raises(KVCacheExhaustedError) as at_gate:
        gate.process("no", prompt.tolist(), SamplingParams(max_tokens=7))
    with pytest.raises(KVCacheExhaustedError) as at_scheduler:
        sched.add(1, prompt, 7)
    tail = str(at_scheduler.value).removeprefix("request 1")
    assert str(at_gate.value) == "the request" + tail
    assert at_gate.value.param == at_scheduler.value.param == "max_tokens"


def test_min_tokens_rule() -> None:
    check_min_tokens(0, 0)
    check_min_tokens(5, 5)
    check_min_tokens(10**6, None)             # no budget yet: only the lower bound
    for bad, budget in ((6, 5), (-1, None), (True, 5), (1.0, 5), ("1", None)):
        with pytest.raises(InvalidRequestError) as e:
            check_min_tokens(bad, budget)
        assert e.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError, match=r"^min_tokens must be an integer in "
                       r"\[0, max_completion_tokens \(5\)\], got 6$"):
        check_min_tokens(6, 5, "max_completion_tokens")
    with pytest.raises(InvalidRequestError, match=r"^min_tokens must be an integer >= 0, "
                       r"got -1$"):
        check_min_tokens(-1, None)


def test_the_gate_checks_min_tokens_against_the_given_and_the_resolved_budget(
        tok: Tokenizer) -> None:
    gate = InputProcessor(tok, RequestLimits(512, 512, 8, 20, 64, 16), (2,))
    with pytest.raises(InvalidRequestError, match=r"\[0, max_completion_tokens \(4\)\]") as e:
        gate.check_params(SamplingParams(max_tokens=4, min_tokens=5), CHAT)
    assert e.value.param == "min_tokens"
    # no max_tokens: the rest of the context (500 tokens here) is the budget
    gate.process("r", [1] * 12, SamplingParams(max_tokens=None, min_tokens=500))
    with pytest.raises(InvalidRequestError, match=r"\[0, max_completion_tokens \(500\)\], "
                       r"got 501") as e:
        gate.process("r", [1] * 12, SamplingParams(max_tokens=None, min_tokens=501),
                     names=CHAT)
    assert e.value.param == "min_tokens"


def test_a_tokenizer_of_another_model_is_warned_about(tok: Tokenizer, caplog) -> None:
    """The bundled tokenizer (512 tokens) over a 49,152-token model: one start-up warning;
    the model's own (or a padded vocabulary) none."""
    with caplog.at_level("WARNING", logger="nybble.runtime.frontend.input_processor"):
        InputProcessor(tok, RequestLimits(64, 512, 8, 20, 4, 4), (2,))
        InputProcessor(tok, RequestLimits(64, 544, 8, 20, 4, 4), (2,))   # padded rows
        assert not caplog.records
        InputProcessor(tok, RequestLimits(64, 49152, 8, 20, 4, 4), (2,))
        InputProcessor(tok, RequestLimits(64, 256, 8, 20, 4, 4), (2,))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("the tokenizer has 512 tokens but the model's vocabulary has "
                                  "49152: is the tokenizer (--tokenizer) the model's?")
    assert "vocabulary has 256" in messages[1]
