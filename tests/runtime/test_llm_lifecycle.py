"""``LLM`` lifecycle (issue: a second tensor-parallel ``LLM`` in one process): ``shutdown()``
and the context manager stop the engine; generating afterwards is a clear error; a new LLM
after it works and answers the same; unfinished requests are aborted by it."""
from __future__ import annotations

import pytest

from nybble import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_context_manager_shuts_down_and_a_new_llm_answers_the_same() -> None:
    with LLM(threads=1) as llm:
        first = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(RuntimeError, match="this engine was shut down"):
        llm.generate("Once upon a time", GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="this engine was shut down"):
        llm.llm_engine.step()
    llm.shutdown()   # idempotent
    again = LLM(threads=1)
    try:
        out = again.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        again.shutdown()
    assert list(out) == list(first) and len(first) == 8


def test_shutdown_aborts_unfinished_requests() -> None:
    llm = LLM(threads=1)
    engine = llm.llm_engine
    engine.add_request("a", "Once upon a time", GREEDY)
    engine.step()
    assert engine.has_unfinished_requests()
    llm.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.get_stats().num_running == 0
