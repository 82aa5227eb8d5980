"""Benchmarks of nybble: offline throughput against Hugging Face ``generate`` and online
serving latency (the methodology of ``vllm bench throughput`` / ``vllm bench serve``).

Modules:
    workloads: seeded synthetic request sets (long-tailed or fixed lengths).
    models: the bundled stories260k and a cached randomly initialised Llama of realistic shape.
    hf_runner: the Hugging Face static-batching baseline with KV-waste sampling.
    throughput: ``nybble bench throughput``.
    serve: ``nybble bench serve``.
    report: the printed table and the JSON file every command writes.
"""
from __future__ import annotations
