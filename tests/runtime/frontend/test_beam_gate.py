"""The request gate's beam-search checks: each bad value is an ``InvalidRequestError`` (a
``ValueError``; a 400 on the server) naming the parameter; ``LLM.beam_search`` raises it."""
from __future__ import annotations

import pytest

from nybble import BeamSearchParams, SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError, KVCacheExhaustedError
from nybble.runtime.frontend.input_processor import InputProcessor, RequestLimits
from nybble.tokenizer.tokenizer import Tokenizer

LIMITS = RequestLimits(max_model_len=512, vocab_size=512, max_num_seqs=8, max_logprobs=20,
                       num_kv_blocks=64, block_size=16)
PROMPT = [1, 5, 9, 200]


@pytest.fixture(scope="module")
def gate() -> InputProcessor:
    return InputProcessor(Tokenizer.from_folder(DEFAULT_MODEL), LIMITS, (2, 1))


def beam(**kw) -> SamplingParams:
    return SamplingParams(**{"n": 2, "use_beam_search": True, "temperature": 0.0, **kw})


@pytest.mark.parametrize("params,param,fragment", [
    (beam(beam_width=0, n=1), "beam_width", "beam_width must be an integer >= 1"),
    (beam(n=0), "n", "n must be an integer >= 1"),
    (beam(n=3, beam_width=2), "n", "n must be <= the beam width (2)"),
    (beam(temperature=0.7), "temperature", "temperature must be 0 with use_beam_search"),
    (beam(logprobs=2), "logprobs", "logprobs must be unset with use_beam_search"),
    (beam(stop=["."]), "stop", "stop must be unset with use_beam_search"),
    (beam(length_penalty=float("nan")), "length_penalty", "length_penalty must be a finite"),
    (beam(early_stopping="sometimes"), "early_stopping", "early_stopping must be true, false"),
    (beam(n=9), "n", "n must be <= 8 (max_num_seqs"),
    # 8 beams x (1 + 99 stop ids, EOS included) candidates per step > 512 tokens
    (beam(beam_width=8, n=1, stop_token_ids=list(range(3, 100))), "beam_width",
     "beam_width must be at most 5"),
    (SamplingParams(length_penalty=2.0), "length_penalty",
     "length_penalty must be 1.0 unless use_beam_search"),
    (SamplingParams(early_stopping=True), "early_stopping", "unless use_beam_search"),
    (SamplingParams(beam_width=2), "beam_width", "unless use_beam_search"),
    (SamplingParams(use_beam_search=1), "use_beam_search", "true or false"),
    (beam(logit_bias={5: 1.0}), "logit_bias", "logit_bias must be unset with use_beam_search"),
    (beam(min_tokens=2), "min_tokens", "min_tokens must be unset with use_beam_search"),
    (beam(repetition_penalty=1.2), "repetition_penalty", "unset with use_beam_search"),
    (beam(presence_penalty=0.5), "presence_penalty", "unset with use_beam_search"),
    (beam(frequency_penalty=0.5), "frequency_penalty", "unset with use_beam_search"),
    (beam(bad_words=["dog"]), "bad_words", "unset with use_beam_search"),
    (beam(allowed_token_ids=[5, 9]), "allowed_token_ids", "unset with use_beam_search"),
])
def test_bad_beam_parameters_name_the_parameter(gate: InputProcessor, params: SamplingParams,
                                                param: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        gate.process("r", PROMPT, params)
    assert isinstance(info.value, ValueError)
    assert info.value.param == param
    assert fragment in str(info.value)


def test_beams_must_all_fit_the_pool(gate: InputProcessor) -> None:
    # one sequence of 4 + 252 tokens needs 16 blocks: fine alone, not 4 at once in 64 - 1
    gate.process("ok", PROMPT, SamplingParams(n=4, temperature=0.0, max_tokens=252))
    gate.process("ok", PROMPT, beam(n=4, max_tokens=252))
    with pytest.raises(KVCacheExhaustedError, match="4 beams x"):
        gate.process("r", PROMPT, beam(n=4, max_tokens=253))


def test_llm_beam_search_raises_value_error_naming_the_parameter() -> None:
    from nybble import LLM
    llm = LLM(DEFAULT_MODEL, num_gpu_blocks=64)
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        llm.beam_search(["Once"], BeamSearchParams(beam_width=0, max_tokens=4))
    with pytest.raises(ValueError, match="temperature must be 0"):
        llm.beam_search(["Once"], BeamSearchParams(beam_width=2, max_tokens=4,
                                                   temperature=0.5))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        llm.beam_search(["Once"], BeamSearchParams(beam_width=2, max_tokens=0))
    assert not llm.llm_engine.has_unfinished_requests()
