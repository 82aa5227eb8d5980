"""Prometheus metrics of multi-LoRA serving, set from each step's engine stats.

* ``nybble:lora_requests_info`` (vLLM's ``vllm:lora_requests_info``): one series whose labels
  name the adapters of the running and of the waiting requests (comma-separated, sorted) and
  ``max_lora`` (the device slots); its value is the time it was set (Unix seconds);
* ``nybble:lora_num_requests_running`` / ``nybble:lora_num_requests_waiting``: requests per
  adapter (label ``lora_name``) that hold a device slot / wait for one (a request whose adapter
  finds every slot in use waits; docs/lora.md).

Series of adapters with no request are dropped at each update.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge

from nybble.runtime.messages import EngineStats


class LoRAMetrics:
    """The LoRA gauges in ``registry``, for the served model ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.info = Gauge("nybble:lora_requests_info",
                          "Running and waiting LoRA adapters (labels); value: when set.",
                          ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                          registry=registry)
        self.running = Gauge("nybble:lora_num_requests_running",
                             "Requests per LoRA adapter that hold a device slot.",
                             ["model_name", "lora_name"], registry=registry)
        self.waiting = Gauge("nybble:lora_num_requests_waiting",
                             "Requests per LoRA adapter waiting for a device slot.",
                             ["model_name", "lora_name"], registry=registry)

    def update(self, stats: EngineStats) -> None:
        """Set the gauges from one step's stats."""
        self.info.clear()
        self.info.labels(",".join(sorted(stats.lora_running)),
                         ",".join(sorted(stats.lora_waiting)),
                         str(stats.max_loras)).set(time.time())
        for gauge, counts in ((self.running, stats.lora_running),
                              (self.waiting, stats.lora_waiting)):
            gauge.clear()
            for name, count in counts.items():
                gauge.labels(self.model_name, name).set(count)
