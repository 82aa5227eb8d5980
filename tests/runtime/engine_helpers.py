"""Engine test helpers: build a small engine on the bundled model, drive it to the end, and
check that it is idle with nothing leaked."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from nybble.config import DEFAULT_MODEL
from nybble.outputs import RequestOutput
from nybble.runtime.llm_engine import LLMEngine
from nybble.sampling_params import SamplingParams


def make_engine(**kw: Any) -> LLMEngine:
    """An engine on the bundled stories260k model with ``kw`` engine arguments."""
    return LLMEngine.from_engine_args(DEFAULT_MODEL, **kw)


def run_requests(engine: LLMEngine,
                 requests: Iterable[tuple[str, str | Sequence[int], SamplingParams]]
                 ) -> dict[str, RequestOutput]:
    """Add every ``(request_id, prompt, params)``, step until all are done; the final output
    of each request id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def assert_idle_and_clean(engine: LLMEngine) -> None:
    """Nothing runs or waits, every KV block is free (no reference left), no sampling row,
    logit-shaping row or prompt-logprobs tracking, no request on either side, and the load
    gauges read 0."""
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks and stats.kv_cache_usage == 0.0
    assert stats.num_live_tokens == 0
    state = engine.scheduler.debug_state()
    assert int(np.count_nonzero(state["ref_counts"])) == 0 and not state["seqs"]
    assert len(engine.engine_core.runner.sampling) == 0, "sampling rows leaked"
    assert len(engine.engine_core.runner.shaping) == 0, "logit-shaping rows leaked"
    assert len(engine.engine_core.runner.prompt_logprobs) == 0, "prompt tracking leaked"
    assert not engine.engine_core.has_unfinished_requests()
    assert not engine.has_unfinished_requests() and not engine.requests
