"""With speculative decoding on, the request gate refuses the parameters its verification does
not apply (beam search, structured output, prompt logprobs), naming each; the same requests
pass when it is off. Logit shaping and min_tokens pass."""
from __future__ import annotations

import pytest

from nybble import SamplingParams
from nybble.sampling_params import GuidedDecodingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError
from nybble.runtime.frontend.input_processor import InputProcessor, RequestLimits
from nybble.tokenizer.tokenizer import Tokenizer

LIMITS = dict(max_model_len=512, vocab_size=512, max_num_seqs=8, max_logprobs=20,
              num_kv_blocks=64, block_size=16)
PROMPT = [1, 5, 9, 200]


@pytest.fixture(scope="module")
def gates() -> tuple[InputProcessor, InputProcessor]:
    tok = Tokenizer.from_folder(DEFAULT_MODEL)
    return (InputProcessor(tok, RequestLimits(**LIMITS, speculative=True), (2, 1)),
            InputProcessor(tok, RequestLimits(**LIMITS), (2, 1)))


@pytest.mark.parametrize("param,value", [
    ("use_beam_search", True), ("guided_decoding", GuidedDecodingParams(regex="[ab]+")),
    ("prompt_logprobs", 1), ("prompt_logprobs", 0),
])
def test_speculation_refuses_what_it_does_not_apply(gates: tuple[InputProcessor, InputProcessor],
                                                    param: str, value: object) -> None:
    spec, plain = gates
    params = SamplingParams(temperature=0.0, max_tokens=8, **{param: value})
    with pytest.raises(InvalidRequestError) as info:
        spec.process("r", PROMPT, params)
    assert info.value.param == param
    assert "unset while speculative decoding is on" in str(info.value)
    plain.process("r", PROMPT, params)      # allowed without speculation


def test_plain_requests_pass_with_speculation(gates: tuple[InputProcessor, InputProcessor]) -> None:
    spec, _ = gates
    spec.process("r", PROMPT, SamplingParams(temperature=0.8, n=2, seed=3, logprobs=2,
                                             stop=["."], max_tokens=8, repetition_penalty=1.0))
    spec.process("r", PROMPT, SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=8, stop_token_ids=[9], logit_bias={5: 1.0},
        repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
        bad_words=["dog", "was happy"], allowed_token_ids=[5, 9, 11]))
