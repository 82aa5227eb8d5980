"""/metrics: counters equal the responses' usage, one TTFT observation per request, gauges
back to 0 when idle."""
from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]


def test_metric_names_are_vllm_like(server: Server) -> None:
    names = set(server.metrics())
    for name in ["nybble:num_requests_running", "nybble:num_requests_waiting",
                 "nybble:kv_cache_usage_perc", "nybble:prompt_tokens_total",
                 "nybble:generation_tokens_total", "nybble:num_preemptions_total",
                 "nybble:time_to_first_token_seconds_count",
                 "nybble:inter_token_latency_seconds_count",
                 "nybble:e2e_request_latency_seconds_count",
                 "nybble:request_queue_time_seconds_count"]:
        assert name in names, name


def test_counters_match_usage_after_n_requests(server: Server, client: openai.OpenAI) -> None:
    server.wait_idle()
    before = server.metrics()
    usages = []
    for i in range(3):
        out = client.completions.create(model="stories260k", prompt=f"Story {i}: a cat",
                                        max_tokens=5 + 7 * i, temperature=0.0)
        usages.append(out.usage)
    chat = client.chat.completions.create(model="stories260k", max_tokens=11,
                                          messages=[{"role": "user", "content": "A frog."}])
    usages.append(chat.usage)
    chunks = list(client.completions.create(model="stories260k", prompt="The moon", stream=True,
                                            max_tokens=9, stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    n = len(usages)
    server.wait_idle()
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("nybble:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("nybble:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("nybble:request_success_total") == n
    assert delta("nybble:time_to_first_token_seconds_count") == n
    assert delta("nybble:e2e_request_latency_seconds_count") == n
    assert delta("nybble:request_queue_time_seconds_count") == n
    # one inter-token gap per token after a request's first (n=1 requests)
    assert delta("nybble:inter_token_latency_seconds_count") == \
        sum(u.completion_tokens - 1 for u in usages)
    assert after["nybble:num_requests_running"] == 0
    assert after["nybble:num_requests_waiting"] == 0
    assert after["nybble:kv_cache_usage_perc"] == 0


def test_speculative_decoding_counters_follow_the_engine() -> None:
    """vLLM's spec_decode counters appear once the engine reports them, and grow by what the
    cumulative stats gained."""
    from nybble.runtime.frontend.async_engine import StepRecord
    from nybble.runtime.messages import EngineStats, SpecDecodeStats
    from nybble.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    base = {"num_running": 1, "num_waiting": 0, "num_free_blocks": 9, "num_blocks": 10,
            "kv_cache_usage": 0.1, "num_preemptions": 0, "peak_num_seqs_in_step": 1,
            "num_steps": 3, "num_live_tokens": 5, "block_size": 16}
    metrics.observe(StepRecord([], EngineStats(**base)))
    assert b"spec_decode" not in metrics.render()
    for spec in (SpecDecodeStats(2, 6, 3, [2, 1, 0]), SpecDecodeStats(5, 15, 9, [5, 3, 1])):
        metrics.observe(StepRecord([], EngineStats(**base, spec_decode=spec)))
    text = metrics.render().decode()
    assert 'nybble:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'nybble:spec_decode_num_draft_tokens_total{model_name="m"} 15.0' in text
    assert 'nybble:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    for pos, count in enumerate((5, 3, 1)):
        assert (f'nybble:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
                f'position="{pos}"}} {count}.0') in text
