"""LLMEngine: gate -> engine core -> output processor, one iteration per :meth:`LLMEngine.step`.

Continuous (iteration-level) batching as in Orca (Yu et al., OSDI 2022) over a paged KV cache
(PagedAttention, Kwon et al., SOSP 2023). The engine is vLLM V1's three parts in one process:

- :class:`InputProcessor` (the request gate) tokenizes, completes and checks each request once
  and hands the core an :class:`EngineCoreRequest`;
- :class:`EngineCore` (Cython scheduler + model runner) decides which tokens run, computes and
  samples them, and returns token ids (:class:`EngineCoreOutputs`);
- :class:`OutputProcessor` turns token ids into text, applies stop strings and reports
  cumulative :class:`RequestOutput` objects (vLLM's API).

The parts talk only through those typed messages. Here the core runs in-process (offline
``LLM``); ``nybble serve`` runs the same :class:`EngineCore` in its own process
(:mod:`nybble.runtime.engine.core_process`) behind the same messages.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nybble.config import EngineConfig
from nybble.errors import EngineStepError
from nybble.models.loader import LoadedModel
from nybble.outputs import RequestOutput
from nybble.runtime.engine.engine_core import EngineCore
from nybble.tokenizer.hf_tokenizer import load_tokenizer
from nybble.runtime.frontend.input_processor import DEFAULT_NAMES, InputProcessor, ParamNames
from nybble.runtime.worker.kv_plan import KVCacheSpec
from nybble.runtime.messages import EngineCoreRequest, EngineStats
from nybble.runtime.frontend.output_processor import OutputProcessor
from nybble.runtime.frontend.request import Request
from nybble.runtime.scheduler.scheduler import Scheduler
from nybble.runtime.worker.torch_threads import apply_torch_threads
from nybble.lora_request import LoRARequest
from nybble.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    """The engine: add requests, call :meth:`step` until :meth:`has_unfinished_requests` is
    false. Not thread-safe: drive it from one thread.

    Raises (constructor):
        UnsupportedModelError: the model folder cannot be served.
        ValueError: a configuration value out of range.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        mc.check_folders()
        self.tokenizer, _ = load_tokenizer(mc.tokenizer_folder)
        if config.threads is not None:
            apply_torch_threads(config.threads, "threads")
        self.engine_core = EngineCore(config)
        core = self.engine_core
        self.input_processor = InputProcessor(self.tokenizer, core.request_limits(),
                                              core.loaded.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.model_name = mc.name
        self.max_model_len = core.max_model_len
        self.vocab_size = core.loaded.shape.vocab_size
        self._closed = False

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs: Any) -> LLMEngine:
        """Build from vLLM-style keyword arguments (see :meth:`EngineConfig.from_kwargs`)."""
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # Views of the core's parts, for tests, benchmarks and logs.
    @property
    def scheduler(self) -> Scheduler:
        """The engine core's Cython scheduler."""
        return self.engine_core.scheduler

    @property
    def loaded(self) -> LoadedModel:
        """The loaded model."""
        return self.engine_core.loaded

    @property
    def kv_spec(self) -> KVCacheSpec:
        """The KV pool."""
        return self.engine_core.kv_spec

    @property
    def requests(self) -> dict[str, Request]:
        """The requests in flight, by id (their output-side state)."""
        return self.output_processor.requests

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    names: ParamNames = DEFAULT_NAMES,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (text prompt, or token ids used as they are).

        Args:
            names: the API's parameter names, for the ``param`` of a rejection.
            lora_request: the LoRA adapter it runs under (``None``: the base model; the
                engine needs ``enable_lora``).

        Raises:
            InvalidRequestError: duplicate id, or any check of the request gate
                (:mod:`nybble.runtime.frontend.input_processor`) failed; nothing is queued then.
            RuntimeError: the engine was shut down.
        """
        self.check_open()
        request = self.input_processor.process(request_id, prompt, params, arrival_time, names,
                                               lora_request)
        self.add_core_request(request, prompt if isinstance(prompt, str) else None)

    def add_core_request(self, request: EngineCoreRequest, prompt: str | None = None) -> None:
        """Queue a request the gate has already processed (``self.input_processor``).

        Args:
            prompt: the prompt's text, if it had one (reported in ``RequestOutput.prompt``).

        Raises:
            InvalidRequestError: the request id is already in flight.
        """
        self.output_processor.check_new(request.request_id)
        self.engine_core.add_request(request)
        try:
            self.output_processor.add_request(request, prompt)
        except BaseException:  # NOTE: all or nothing: the core forgets it too
            self.engine_core.abort_requests([request.request_id])
            raise

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests now; their KV blocks are freed at once. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.output_processor.abort_request(rid)
        self.engine_core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.output_processor.has_unfinished_requests()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule -> execute -> update -> detokenize. Returns a cumulative
        :class:`RequestOutput` for every request that produced tokens in this step.

        Raises:
            EngineStepError: the step failed; the requests of its batch
                (``error.request_ids``) were aborted and are forgotten, the others go on
                with the next :meth:`step`.
            RuntimeError: the engine was shut down.
        """
        self.check_open()
        failed = self.engine_core.take_failed_admissions()   # NOTE: by the previous step
        if failed:
            for rid, _, _ in failed:
                self.output_processor.abort_request(rid)
            raise EngineStepError([rid for rid, _, _ in failed],
                                  f"LoRA admission failed: {failed[0][1]}")
        try:
            core_outputs = self.engine_core.step()
        except EngineStepError as e:
            for rid in e.request_ids:
                self.output_processor.abort_request(rid)
            raise
        if core_outputs is None:
            return []
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.stop_samples(stopped)
        return outputs

    def shutdown(self) -> None:
        """Abort every unfinished request and stop the engine core (its tensor-parallel
        workers and process group); idempotent. Afterwards :meth:`add_request` and
        :meth:`step` raise ``RuntimeError``."""
        if self._closed:
            return
        self._closed = True
        ids = list(self.output_processor.requests)
        if ids:
            self.abort_request(ids)
        self.engine_core.shutdown()

    def check_open(self) -> None:
        """Raises: RuntimeError: :meth:`shutdown` was called."""
        if self._closed:
            raise RuntimeError("this engine was shut down (LLM.shutdown() or the end of its "
                               "`with` block): create a new LLM to generate again")

    def get_stats(self) -> EngineStats:
        """Current load; see :class:`EngineStats`."""
        return self.engine_core.get_stats()
