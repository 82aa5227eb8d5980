"""``max_tokens`` 0 (score the prompt only) is decided once, by the gate, as
``EngineCoreRequest.prompt_only``: the engine core runs such a request for one token and the
output side drops it, each reading the field, never a 0 budget."""
from __future__ import annotations

import pytest

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.runtime.frontend.input_processor import InputProcessor, RequestLimits
from nybble.runtime.frontend.output_processor import OutputProcessor
from nybble.runtime.messages import Codec, CoreInputs, EngineCoreOutputs, EngineCoreRequest
from nybble.tokenizer.tokenizer import Tokenizer
from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine

LIMITS = RequestLimits(max_model_len=512, vocab_size=512, max_num_seqs=8, max_logprobs=20,
                       num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(DEFAULT_MODEL)


@pytest.mark.parametrize("max_tokens,prompt_only", [(0, True), (1, False), (None, False)])
def test_the_gate_sets_prompt_only_for_a_zero_budget(tok: Tokenizer, max_tokens: int | None,
                                                     prompt_only: bool) -> None:
    gate = InputProcessor(tok, LIMITS, (2,))
    req = gate.process("r", [1, 5, 9], SamplingParams(max_tokens=max_tokens))
    assert req.prompt_only is prompt_only
    assert (req.max_tokens == 0) is prompt_only
    # the field crosses the socket to the engine-core process
    (back,) = Codec(CoreInputs).decode(Codec(CoreInputs).encode(CoreInputs(adds=[req]))).adds
    assert back.prompt_only is prompt_only and back == req


def _hand_made(rid: str, max_tokens: int, prompt_only: bool) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 5, 9], SamplingParams(max_tokens=max_tokens), [2], 0.0,
                             prompt_only=prompt_only)


def test_the_output_side_reads_the_field(tok: Tokenizer) -> None:
    """A sampled token is dropped for a prompt-only request and kept otherwise, whatever the
    budget says (both requests are hand-made: the gate never sends these pairs)."""
    out = OutputProcessor(tok)
    out.add_request(_hand_made("only", 1, True), None)
    out.add_request(_hand_made("zero", 0, False), None)
    step = EngineCoreOutputs(request_ids=["only", "zero"], sample_indices=[0, 0],
                             token_ids=[7, 7], finish_reasons=[2, 2])
    results = {o.request_id: o for o in out.process_outputs(step)[0]}
    only, zero = results["only"], results["zero"]
    assert only.outputs[0].token_ids == [] and only.outputs[0].finish_reason == "length"
    assert only.finished and only.num_new_tokens == 0
    assert zero.outputs[0].token_ids == [7] and zero.outputs[0].finish_reason == "length"
    assert zero.num_new_tokens == 1


def test_the_core_runs_a_prompt_only_request_for_one_token() -> None:
    engine = make_engine(max_num_seqs=4)
    core = engine.engine_core
    core.add_request(_hand_made("only", 0, True))
    (seq_id,) = core.seq_ids("only")
    assert engine.scheduler.debug_state()["seqs"][seq_id]["max_tokens"] == 1
    # a 0 budget without the field is not read as scoring: the scheduler refuses it whole
    with pytest.raises(ValueError, match="max_tokens` must be >= 1"):
        core.add_request(_hand_made("zero", 0, False))
    assert core.request_ids() == ["only"]
    while core.has_unfinished_requests():
        core.step()
    assert_idle_and_clean(engine)
