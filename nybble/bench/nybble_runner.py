"""The nybble side of ``nybble bench throughput``: ``LLM.generate`` with per-step KV sampling.

The timed call is the public ``LLM.generate`` (all requests submitted at once, like
``vllm bench throughput``). To sample the KV cache after every engine step without changing
that path, the engine's ``step`` is wrapped on the instance: after each step it reads
``get_stats()`` and records ``allocated = (num_blocks - num_free_blocks) * block_size`` slots
against the live tokens (KV entries of sequences that still hold blocks).
"""
from __future__ import annotations

import time
from typing import Any

from nybble.bench.stats import BackendResult, WasteTracker
from nybble.bench.workloads import BenchRequest


def live_tokens(stats: Any) -> int:
    """Tokens whose KV entries belong to sequences that still hold blocks after a step
    (``EngineStats.num_live_tokens``: the step's sequences minus those that finished in it)."""
    return int(stats.num_live_tokens)


class _StepSampler:
    """Wraps ``engine.step`` to sample KV waste and count steps; ``restore()`` unwraps it."""

    def __init__(self, engine: Any, block_size: int) -> None:
        self.engine = engine
        self.block_size = block_size
        self.tracker = WasteTracker()
        self.steps = 0
        self._orig = engine.step
        engine.step = self._step

    def _step(self) -> list[Any]:
        outs = self._orig()
        stats = self.engine.get_stats()
        live = live_tokens(stats)
        used = int(stats.num_blocks) - int(stats.num_free_blocks)
        self.tracker.add(live, used * int(getattr(stats, "block_size", self.block_size)))
        self.steps += 1
        return outs

    def restore(self) -> None:
        """Put the engine's own ``step`` back."""
        del self.engine.step


def make_llm(model: str, engine_kwargs: dict[str, Any]) -> Any:
    """Build ``nybble.LLM(model, **engine_kwargs)``."""
    from nybble import LLM

    return LLM(model, **engine_kwargs)


def engine_of(llm: Any) -> Any:
    """The ``LLMEngine`` inside an ``LLM`` (vLLM's attribute name ``llm_engine``)."""
    for name in ("llm_engine", "engine"):
        if hasattr(llm, name):
            return getattr(llm, name)
    raise AttributeError("nybble.LLM exposes no llm_engine attribute")


def run_nybble(llm: Any, requests: list[BenchRequest], block_size: int) -> BackendResult:
    """Generate ``requests`` (greedy, ``ignore_eos``, exact lengths) with ``llm.generate``."""
    from nybble import SamplingParams

    engine = engine_of(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    prompts = [r.prompt_token_ids for r in requests]
    stats0 = engine.get_stats()
    sampler = _StepSampler(engine, block_size)
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        sampler.restore()
    stats1 = engine.get_stats()
    counted = sum(min(len(o.outputs[0].token_ids), r.output_len)
                  for o, r in zip(outputs, requests))
    return BackendResult(
        backend="nybble", elapsed_s=elapsed, num_requests=len(outputs),
        prompt_tokens=sum(r.prompt_len for r in requests), output_tokens=counted,
        num_steps=sampler.steps, kv_waste_mean=sampler.tracker.mean,
        kv_waste_peak=sampler.tracker.peak,
        extra={"num_blocks": int(stats1.num_blocks), "block_size": block_size,
               "num_preemptions": int(stats1.num_preemptions) - int(stats0.num_preemptions),
               "peak_num_seqs_in_step": getattr(stats1, "peak_num_seqs_in_step", None),
               "kv_waste_source": "paged blocks in use vs EngineStats.num_live_tokens, "
                                  "sampled after every engine step"})
