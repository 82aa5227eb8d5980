"""Prometheus metrics, named like vLLM's with the ``nybble:`` prefix and a ``model_name`` label.

Definitions (``docs/serving.md §2.1``): TTFT is first token minus HTTP arrival (so
it includes tokenization); ITL is the gap between a request's consecutive token steps; e2e is
finish minus arrival; queue time is first scheduled minus arrival. All times are seconds from
``time.monotonic()``. Token counters match the responses' ``usage``: prompt tokens are counted
once per engine request when its first token arrives, generation tokens as they are generated.
Gauges are set from ``engine.get_stats()`` after every step and once more when the engine goes
idle, so they read 0 / 0 / 0 when nothing runs; running and waiting count the scheduler's
sequences, as vLLM V1 counts its child requests (a request with ``n`` samples counts once
while waiting, ``n`` times once its prompt is prefilled and it forked; ``docs/serving.md
§2.2``). ``request_success`` counts every request that ended: ``finished_reason`` ``stop`` or
``length``, ``abort`` (client gone, shutdown) or ``error`` (the engine failed it); TTFT is
observed once per request that produced a token, never for one aborted or failed before
its first token, nor for a rejected one.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nybble.outputs import RequestOutput
from nybble.runtime.frontend.async_engine import StepRecord
from nybble.runtime.messages import SpecDecodeStats
from nybble.server.lora_metrics import LoRAMetrics

# vLLM's buckets (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's metrics in their own registry (several apps can live in one process).

    Use :meth:`observe` as the :class:`AsyncEngine` step observer (on the event loop, as
    each step's outputs arrive from the engine-core process) and
    :meth:`render` for ``GET /metrics``.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, lab = self.registry, ["model_name"]
        self.running = Gauge("nybble:num_requests_running", "Requests in the running batch.",
                             lab, registry=reg).labels(model_name)
        self.waiting = Gauge("nybble:num_requests_waiting", "Requests waiting to be scheduled.",
                             lab, registry=reg).labels(model_name)
        self.kv_usage = Gauge("nybble:kv_cache_usage_perc",
                              "KV-cache usage, fraction of blocks in use (1 = 100%).",
                              lab, registry=reg).labels(model_name)
        self.prompt_tokens = Counter("nybble:prompt_tokens", "Prefilled prompt tokens.",
                                     lab, registry=reg).labels(model_name)
        self.generation_tokens = Counter("nybble:generation_tokens", "Generated tokens.",
                                         lab, registry=reg).labels(model_name)
        self.request_success = Counter("nybble:request_success",
                                       "Ended requests, by finish reason (stop, length, abort, "
                                       "error).",
                                       ["model_name", "finished_reason"], registry=reg)
        self.preemptions = Counter("nybble:num_preemptions", "Preemptions (recompute).",
                                   lab, registry=reg).labels(model_name)
        self.ttft = Histogram("nybble:time_to_first_token_seconds",
                              "Time to first token (arrival to first token), seconds.",
                              lab, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("nybble:inter_token_latency_seconds",
                             "Time between a request's consecutive token steps, seconds.",
                             lab, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("nybble:e2e_request_latency_seconds",
                             "Arrival to finish, seconds.", lab, buckets=_REQUEST_BUCKETS,
                             registry=reg).labels(model_name)
        self.queue = Histogram("nybble:request_queue_time_seconds",
                               "Arrival to first scheduled, seconds.", lab,
                               buckets=_REQUEST_BUCKETS, registry=reg).labels(model_name)
        self.prefix_queries = Counter(
            "nybble:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            lab, registry=reg).labels(model_name)
        self.prefix_hits = Counter(
            "nybble:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).",
            lab, registry=reg).labels(model_name)
        self._preemptions_seen = self._queries_seen = self._hits_seen = 0
        self._spec: _SpecDecodeMetrics | None = None
        self._lora: LoRAMetrics | None = None

    def observe(self, record: StepRecord) -> None:
        """Update every metric from one engine step (called on the event loop, per step output
        message of the engine-core process)."""
        first = set(record.first_token_ids)
        for out in record.outputs:
            if out.request_id in first:
                self.ttft.observe(_elapsed(out, "first_token_time", record.now))
            if out.finished:
                self._observe_finished(out, record.now)
        for gap in record.itl:
            self.itl.observe(gap)
        if record.aborted:
            self.request_success.labels(self.model_name, "abort").inc(record.aborted)
        if record.failed:
            self.request_success.labels(self.model_name, "error").inc(record.failed)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.generation_tokens)
        stats = record.stats
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
            self.prefix_queries.inc(stats.num_prefix_query_tokens_total - self._queries_seen)
            self.prefix_hits.inc(stats.num_cached_tokens_total - self._hits_seen)
            self._preemptions_seen = stats.num_preemptions
            self._queries_seen = stats.num_prefix_query_tokens_total
            self._hits_seen = stats.num_cached_tokens_total
            if stats.max_loras:
                if self._lora is None:
                    self._lora = LoRAMetrics(self.registry, self.model_name)
                self._lora.update(stats)
            if stats.spec_decode is not None:
                if self._spec is None:
                    self._spec = _SpecDecodeMetrics(self.registry, self.model_name)
                self._spec.update(stats.spec_decode)

    def _observe_finished(self, out: RequestOutput, now: float) -> None:
        reason = next((o.finish_reason for o in out.outputs if o.finish_reason), "stop")
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.observe(_elapsed(out, "finished_time", now))
        if out.metrics is not None and out.metrics.first_scheduled_time is not None:
            self.queue.observe(max(0.0, out.metrics.first_scheduled_time
                                   - out.metrics.arrival_time))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _SpecDecodeMetrics:
    """vLLM's speculative decoding counters (registered when the engine reports them):
    sequence-steps with drafts, drafted and accepted tokens, accepted tokens per position
    (label ``position``, 0-based)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        lab = ["model_name"]
        self.drafts = Counter("nybble:spec_decode_num_drafts",
                              "Speculative decoding: sequence-steps that carried drafts.",
                              lab, registry=registry).labels(model_name)
        self.draft_tokens = Counter("nybble:spec_decode_num_draft_tokens",
                                    "Speculative decoding: drafted tokens.",
                                    lab, registry=registry).labels(model_name)
        self.accepted = Counter("nybble:spec_decode_num_accepted_tokens",
                                "Speculative decoding: accepted draft tokens.",
                                lab, registry=registry).labels(model_name)
        per_pos = Counter("nybble:spec_decode_num_accepted_tokens_per_pos",
                          "Speculative decoding: accepted draft tokens at each position.",
                          ["model_name", "position"], registry=registry)
        self.per_pos = per_pos
        self.model_name = model_name
        self._seen = SpecDecodeStats()

    def update(self, stats: SpecDecodeStats) -> None:
        """Add what the cumulative ``stats`` gained since the last call."""
        seen = self._seen
        self.drafts.inc(stats.num_drafts - seen.num_drafts)
        self.draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.accepted.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, count in enumerate(stats.accepted_per_pos):
            before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            self.per_pos.labels(self.model_name, str(pos)).inc(count - before)
        self._seen = stats


def _elapsed(out: RequestOutput, attr: str, now: float) -> float:
    """``metrics.<attr> - metrics.arrival_time`` in seconds (``now`` when ``attr`` is unset)."""
    if out.metrics is None:
        return 0.0
    stamp = getattr(out.metrics, attr)
    return max(0.0, (stamp if stamp is not None else now) - out.metrics.arrival_time)
