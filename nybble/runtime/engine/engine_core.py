"""EngineCore: the scheduler, the model runner and the step; token ids in, token ids out.

It receives validated :class:`EngineCoreRequest` messages (the request gate has checked them:
the core only asserts), runs ``schedule -> execute -> update`` once per :meth:`EngineCore.step`
and returns one :class:`EngineCoreOutputs` with a row per sampled sequence. It never sees text:
detokenization and stop strings belong to the output side, which reports the samples its stop
strings ended through :meth:`EngineCore.stop_samples`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nybble.config import EngineConfig, ModelConfig
from nybble.model_files import check_model_dir
from nybble.errors import EngineStepError, InvalidRequestError, WorkerFailedError
from nybble.kernels import get_attention_backend
from nybble.models.loader import LoadedModel, load_model
from nybble.quant.report import summarize_report
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.engine.beam_core import BeamCoordinator, add_results
from nybble.runtime.worker.draft_proposer import DraftProposer
from nybble.runtime.scheduler.scheduler_input import pool_tokens, window_blocks
from nybble.runtime.worker.kv_plan import (fit_max_model_len, is_quantized_kv, kv_storage_dtype,
                                           plan_kv_cache, resolve_kv_cache_dtype,
                                           scheduler_window)
from nybble.runtime.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    LoRALimits,
    PromptLogprobs,
    RequestLimits,
    SpecDecodeStats,
)
from nybble.runtime.engine.lora_admission import LoRAAdmission
from nybble.runtime.worker.lora_manager import LoRAManager
from nybble.runtime.worker.model_runner import ModelRunner
from nybble.runtime.scheduler.scheduler import Scheduler
from nybble.runtime.scheduler.sequence import FinishReason
from nybble.runtime.sample.structured_output import GrammarCompiler
from nybble.runtime.executor.factory import start_executor
from nybble.runtime.executor.tp_executor import Executor

logger = logging.getLogger(__name__)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device must be 'cpu' or 'auto' on a machine without CUDA, got 'cuda'")
    return torch.device(name)


def _as_list(array: np.ndarray | None) -> list | None:
    return None if array is None else array.tolist()


@dataclass(slots=True)
class _CoreRequest:
    """The core's record of one request: sequences ``first_seq_id .. + n - 1``, ``num_live``
    of them still running."""

    first_seq_id: int
    n: int
    num_live: int


class EngineCore:
    """Loads the model, plans the KV pool and runs steps. One caller drives it: the offline
    engine (:class:`~nybble.runtime.llm_engine.LLMEngine`, on its caller's thread) or, under
    ``nybble serve``, the busy loop of the engine-core process (its own process:
    :mod:`nybble.runtime.engine.core_process`).

    Raises (constructor):
        UnsupportedModelError: the checkpoint cannot be loaded (architecture, dtype, format).
        ValueError: ``max_model_len`` over the model's limit, or a KV budget under one block.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        check_model_dir(mc.model)
        self.device = _resolve_device(mc.device)
        self.executor: Executor | None = None
        if config.parallel_config.tensor_parallel_size > 1:
            self.executor = start_executor(config)    # workers load their shards meanwhile
            self.device = self.executor.tp.device
        backend = get_attention_backend(config.attention_backend, self.device)
        try:
            self._load(config, backend)
        except BaseException:
            self.shutdown()
            raise

    def _load(self, config: EngineConfig, backend) -> None:
        """Load the model (rank 0's shard under tensor parallelism), plan the KV pool, build
        the runner and the scheduler."""
        mc = config.model_config
        tp = None if self.executor is None else self.executor.tp
        self.loaded: LoadedModel = load_model(mc, backend, self.device, tp)
        vocab = self.loaded.shape.vocab_size
        if mc.max_logprobs > vocab:
            raise ValueError(f"max_logprobs must be <= {vocab} (the model's vocabulary), got "
                             f"{mc.max_logprobs}")
        # NOTE: auto is bfloat16 for a quantized float32 model on the CPU's rounding path
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype,
                                                     self.loaded.dtype,
                                                     self.loaded.cpu_activations)
        if self.kv_cache_dtype != config.cache_config.kv_cache_dtype:
            logger.info("KV cache dtype auto: bfloat16 for a quantized model on the CPU's %s "
                        "activation path (--kv-cache-dtype float32 keeps float32; "
                        "--cpu-activation-dtype float32, the exact path, does too)",
                        self.loaded.cpu_activations)
        self.kv_spec = plan_kv_cache(
            dataclasses.replace(config.cache_config, kv_cache_dtype=self.kv_cache_dtype),
            self.loaded.shard_shape, self.loaded.dtype, self.device, self.loaded.max_model_len)
        # blocks out of a sliding window are freed (None: every block kept)
        self.kv_window = scheduler_window(self.loaded, config)
        self._fit_max_model_len(mc.max_model_len is not None)
        if is_quantized_kv(self.kv_spec.dtype):
            from nybble.runtime.worker.kv_calibration import calibrate_kv_scales

            # NOTE: before the runner: CUDA graphs capture the layers' kv_scale tensors
            calibrate_kv_scales(self.loaded, self.kv_spec.dtype, self.device)
        self.grammars = GrammarCompiler(mc.tokenizer_folder, vocab, self.loaded.eos_token_ids)
        self.max_model_len = self.loaded.max_model_len
        spec = config.speculative_config
        proposer = None
        if spec is not None and spec.model is not None:
            proposer = DraftProposer(self._load_draft(backend), self.kv_spec, self.device)
        lora = None
        if config.lora_config.enable_lora:
            lora = LoRAManager(self.loaded.model, config.lora_config)
        self.runner = ModelRunner(self.loaded, self.kv_spec, self.device, config, proposer, lora)
        self.lora = None if lora is None else LoRAAdmission(lora, self._admit_lora)
        self._matchers: dict[str, list] = {}    # LoRA requests' grammars until admitted
        # (request id, message, param) of LoRA requests whose admission failed after waiting
        self.failed_admissions: list[tuple[str, str, str | None]] = []
        if self.executor is not None:
            self.executor.setup(self.kv_spec.num_blocks)
            self.runner.step_hook = self.executor.send_step
            if lora is not None:
                lora.on_write = self.executor.send_lora
        sc = config.scheduler_config
        ngram = spec is not None and spec.method == "ngram"
        self.scheduler = Scheduler(self.kv_spec.num_blocks, self.kv_spec.block_size,
                                   sc.max_num_seqs, sc.max_num_batched_tokens,
                                   self.max_model_len, sc.enable_chunked_prefill,
                                   enable_prefix_caching=config.cache_config.enable_prefix_caching,
                                   num_lookahead_slots=0 if spec is None
                                   else spec.num_speculative_tokens,
                                   ngram_min=spec.lookup_min if ngram else 0,
                                   ngram_max=spec.lookup_max if ngram else 0,
                                   sliding_window=self.kv_window)
        self.spec_stats = SpecDecodeStats.empty(0 if spec is None
                                                else spec.num_speculative_tokens)
        self._requests: dict[str, _CoreRequest] = {}
        self._seqs: dict[int, tuple[str, int]] = {}  # seq id -> (request id, sample index)
        self._unscheduled: dict[int, str] = {}  # first seq id -> request not yet run
        self._next_seq_id = 0
        self._peak_seqs = self._num_steps = self._live_tokens = 0
        self._last_ids = np.zeros(0, np.int64)      # the last step's sequences and seq_lens
        self._last_lens = np.zeros(0, np.int32)
        self._last_finished: list[int] = []
        self._pending: ScheduledBatch | None = None  # scheduled, not yet taken by update()
        self.beams = BeamCoordinator(self.scheduler, self.runner, self._take_seq_ids)
        self._log_start_up()

    def _fit_max_model_len(self, user_set: bool) -> None:
        """Lower the model's own ``max_model_len`` to the KV pool's tokens when a whole sequence
        does not fit (one start-up line says so); a user-set one that does not fit raises
        (:func:`~nybble.runtime.worker.kv_plan.fit_max_model_len`)."""
        spec, wanted = self.kv_spec, self.loaded.max_model_len
        pool = pool_tokens(spec.num_blocks, spec.block_size, self.kv_window,
                           self.config.scheduler_config.max_num_batched_tokens)
        fitted = fit_max_model_len(pool, wanted, user_set)
        if fitted < wanted:
            logger.warning("max_model_len lowered from %d (the model's context) to %d: the KV "
                           "cache holds %d tokens (%d blocks x %d); raise --kv-cache-memory / "
                           "--num-gpu-blocks for the full context", wanted, fitted, fitted,
                           spec.num_blocks, spec.block_size)
            self.loaded = dataclasses.replace(self.loaded, max_model_len=fitted)

    def _load_draft(self, backend) -> LoadedModel:
        """Load the draft model of speculative decoding, checked against the target.

        Raises:
            UnsupportedModelError, ValueError: the draft folder cannot serve this target
                (another tokenizer or vocabulary, a shorter context than ``max_model_len``).
        """
        spec, mc = self.config.speculative_config, self.config.model_config
        assert spec is not None and spec.model is not None
        spec.check_draft(mc.model, mc.tokenizer_folder)
        draft_cfg = ModelConfig(model=spec.model, dtype=mc.dtype, device=mc.device,
                                max_model_len=self.max_model_len)
        try:
            draft = load_model(draft_cfg, backend, self.device)
        except ValueError as e:
            raise ValueError(f"speculative_config.model must handle the target's "
                             f"max_model_len ({self.max_model_len}): {e}") from e
        if draft.dtype != self.loaded.dtype:
            raise ValueError(f"the draft model's dtype must be the target's "
                             f"({self.loaded.dtype}), got {draft.dtype}")
        logger.info("speculative decoding: draft model %s (%d bytes of weights), "
                    "%d tokens per step; its KV cache shares the target's block tables",
                    spec.model, draft.weight_bytes, spec.num_speculative_tokens)
        return draft

    def _log_start_up(self) -> None:
        mc, loaded, spec = self.config.model_config, self.loaded, self.kv_spec
        logger.info("model %s (%s), dtype %s, device %s, quantization %s, weights %d bytes "
                    "(%.2f MiB; linear layers %d bytes)", mc.name, mc.model,
                    str(loaded.dtype).replace("torch.", ""), self.device,
                    loaded.quant_description, loaded.weight_bytes,
                    loaded.weight_bytes / 2**20, loaded.linear_weight_bytes)
        logger.info("KV cache: %d blocks x %d tokens, %s, %d bytes/block, %.2f MiB in all; "
                    "max_model_len %d; prefix caching %s", spec.num_blocks,
                    spec.block_size, str(spec.dtype).replace("torch.", ""), spec.bytes_per_block,
                    spec.total_bytes / 2**20, self.max_model_len,
                    "on" if self.config.cache_config.enable_prefix_caching else "off")
        if self.kv_window is not None:
            logger.info("sliding window %d tokens on every layer: KV blocks out of it are "
                        "freed as a sequence grows (one block is the null block), so a "
                        "sequence holds at most %d blocks at a time", self.kv_window,
                        window_blocks(self.kv_window,
                                      self.config.scheduler_config.max_num_batched_tokens,
                                      spec.block_size))
        report = summarize_report(mc.model)
        if report is not None:  # the quality report `nybble quantize` wrote beside the weights
            logger.info("quantization report: %s", report)
        pool_tokens = spec.num_blocks * spec.block_size
        if is_quantized_kv(spec.dtype):
            # NOTE: compared with the cache `auto` gives this model (bfloat16 on the CPU's
            # rounding paths, else the model's dtype), the one a user would otherwise get
            auto = kv_storage_dtype(resolve_kv_cache_dtype("auto", loaded.dtype,
                                                           loaded.cpu_activations), loaded.dtype)
            auto_elem = torch.empty((), dtype=auto).element_size()
            plain = spec.total_bytes // (spec.bytes_per_block * auto_elem) * spec.block_size
            logger.info("KV cache dtype %s (scales calibrated at start-up, keys cached before "
                        "RoPE): the pool holds %d tokens, %.2fx the %d tokens of the %s cache "
                        "`auto` gives, in the same bytes",
                        self.kv_cache_dtype, pool_tokens,
                        pool_tokens / max(plain, 1), plain, str(auto).replace("torch.", ""))

    def request_limits(self) -> RequestLimits:
        """What the request gate checks requests against."""
        return RequestLimits(
            max_model_len=self.max_model_len, vocab_size=self.loaded.shape.vocab_size,
            max_num_seqs=self.config.scheduler_config.max_num_seqs,
            max_logprobs=self.config.model_config.max_logprobs,
            num_kv_blocks=self.kv_spec.num_blocks, block_size=self.kv_spec.block_size,
            speculative=self.config.speculative_config is not None,
            sliding_window=self.kv_window,
            max_num_batched_tokens=self.config.scheduler_config.max_num_batched_tokens,
            lora=None if self.lora is None else LoRALimits(
                self.config.lora_config.max_loras, self.config.lora_config.max_lora_rank,
                self.lora.manager.targets.num_layers, self.lora.manager.targets.shapes))

    def _take_seq_ids(self, count: int) -> int:
        """Reserve ``count`` consecutive fresh sequence ids; returns the first."""
        first = self._next_seq_id
        self._next_seq_id += count
        return first

    # ----------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a validated request; all or nothing (a failure leaves no trace).

        Every conversion that can fail (a structured-output grammar is compiled here)
        happens before any state changes; the two stateful parts (sampling rows, then the
        scheduler) are undone if the second one raises.

        A request with a LoRA adapter enters the scheduler once its adapter holds a device
        slot (:mod:`~nybble.runtime.engine.lora_admission`); until then it waits here.

        Raises:
            ValueError: the id is already in the core, or a value the gate should have
                refused (a bug upstream); nothing is queued then.
            InvalidRequestError: the grammar engine cannot compile the request's
                structured-output constraint; a LoRA request without ``enable_lora`` or
                with beam search.
            LoRAAdapterError: the request's adapter cannot be served on this base.
        """
        rid, n = request.request_id, request.params.num_sequences
        if rid in self._requests or rid in self.beams.requests or \
                (self.lora is not None and rid in self.lora.waiting):
            raise ValueError(f"request_id must be new to the engine core, got {rid!r} twice")
        if request.lora_request is not None and self.lora is None:
            raise InvalidRequestError("a LoRA adapter needs an engine started with "
                                      "enable_lora (--enable-lora)", param="model")
        if request.params.use_beam_search:
            if request.lora_request is not None:
                raise InvalidRequestError("beam search with a LoRA adapter is not supported",
                                          param="use_beam_search")
            self._unscheduled[self.beams.add(request)] = rid
            return
        guided = request.params.guided_decoding
        matchers = None if guided is None else \
            self.grammars.matchers(self.grammars.compile(guided), n)
        if request.lora_request is None or self.lora is None:
            self._add_sequences(request, matchers)
            return
        self._matchers[rid] = matchers
        try:
            self.lora.add(request)
        except BaseException:
            self._matchers.pop(rid, None)
            raise

    def _admit_lora(self, request: EngineCoreRequest, slot: int) -> None:
        """Put a LoRA request whose adapter holds ``slot`` into the scheduler."""
        assert request.lora_request is not None and self.lora is not None
        matchers = self._matchers.pop(request.request_id, None)
        first = self._add_sequences(request, matchers, request.lora_request.cache_salt)
        self.lora.manager.assign(first, request.params.num_sequences, slot)

    def _add_sequences(self, request: EngineCoreRequest, matchers: list | None,
                       cache_salt: int = 0) -> int:
        """Add the request's sequences to the runner and the scheduler (all or nothing);
        returns the first sequence id."""
        rid, n = request.request_id, request.params.num_sequences
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int32)
        stops = np.asarray(request.stop_token_ids, dtype=np.int32)
        seq_id = self._next_seq_id
        try:
            self.runner.add_request(seq_id, request, matchers)
            # NOTE: a prompt-only request (scoring) runs for one token, which the output side
            # drops; every prompt position must be computed for prompt logprobs
            budget = 1 if request.prompt_only else request.max_tokens
            self.scheduler.add(seq_id, prompt, budget, stops, n,
                               skip_prefix_cache=request.params.prompt_logprobs is not None,
                               cache_salt=cache_salt)
        except BaseException:
            self.runner.remove_sequences(range(seq_id, seq_id + n))
            raise
        self._next_seq_id += n
        self._requests[rid] = _CoreRequest(seq_id, n, n)
        self._unscheduled[seq_id] = rid
        for i in range(n):
            self._seqs[seq_id + i] = (rid, i)
        return seq_id

    def seq_ids(self, request_id: str) -> range:
        """The scheduler sequence ids of a request's samples (for tests and debugging)."""
        r = self._requests[request_id]
        return range(r.first_seq_id, r.first_seq_id + r.n)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests now; their KV blocks and sampling rows are freed. Unknown ids are
        ignored."""
        for rid in request_ids:
            self.beams.abort(rid)
            self._last_finished += self.beams.freed
            self.beams.freed = []
            if self.lora is not None:
                self._matchers.pop(rid, None)
                self.lora.finished(rid)
            record = self._requests.pop(rid, None)
            if record is None:
                continue
            self._forget_lora(record)
            self._unscheduled.pop(record.first_seq_id, None)
            live = [s for s in range(record.first_seq_id, record.first_seq_id + record.n)
                    if s in self._seqs]
            for seq_id in live:
                del self._seqs[seq_id]
                self.scheduler.finish(seq_id, int(FinishReason.ABORTED))
            self.runner.remove_sequences(live)
            self._last_finished += live
        self._note_live_tokens()

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        """Finish samples ``(request_id, index)`` that a stop string ended (``STOPPED``).

        Samples that already ended (their request finished or was aborted meanwhile, as can
        happen when the output side runs in another process) are skipped.
        """
        for rid, index in samples:
            record = self._requests.get(rid)
            seq_id = -1 if record is None else record.first_seq_id + index
            if seq_id not in self._seqs:
                continue
            self.scheduler.finish(seq_id, int(FinishReason.STOPPED))
            self._finish_seq(seq_id)
        self._note_live_tokens()

    def request_ids(self) -> list[str]:
        """The requests in the core (waiting or running)."""
        waiting = [] if self.lora is None else list(self.lora.waiting)
        return list(self._requests) + list(self.beams.requests) + waiting

    def _finish_seq(self, seq_id: int) -> None:
        rid, _ = self._seqs.pop(seq_id)
        self.runner.remove_sequences((seq_id,))
        self._last_finished.append(seq_id)
        record = self._requests[rid]
        record.num_live -= 1
        if record.num_live == 0:
            del self._requests[rid]
            if self.lora is not None:
                self.lora.finished(rid)
                self._forget_lora(record)

    def _forget_lora(self, record: _CoreRequest) -> None:
        """The request's sequences run under no adapter any more."""
        if self.lora is not None:
            self.lora.manager.forget(record.first_seq_id, record.n)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests) or bool(self.beams.requests) or \
            (self.lora is not None and bool(self.lora.waiting))

    # ----------------------------------------------------------------- the step
    def step(self) -> EngineCoreOutputs | None:
        """One iteration: schedule -> execute -> update. ``None`` when nothing ran.

        Raises:
            EngineStepError: the step raised after scheduling; the requests of its batch
                were aborted and rolled back (see :meth:`_roll_back`), every other request
                is untouched and the core can step again. Any other exception (from
                ``schedule()`` itself or from the rollback) means the core's bookkeeping can
                no longer be trusted.
        """
        if self.lora is not None and self.lora.waiting:
            self._admit_waiting_lora()
        batch = self.scheduler.schedule()
        if batch.num_seqs == 0:
            return None
        self._pending = batch
        try:
            return self._run(batch)
        except BaseException as e:
            failed = self._roll_back(batch)
            if not isinstance(e, Exception):  # NOTE: Ctrl-C in LLM.generate: rolled back too
                raise
            cause: BaseException = e
            if self.executor is not None and not isinstance(e, WorkerFailedError) and (
                    self.executor.dead_workers() or isinstance(e, dist.DistError)):
                # NOTE: the ranks are out of step: the engine cannot step again
                cause = WorkerFailedError(f"{'; '.join(self.executor.dead_workers())} "
                                          f"({type(e).__name__}: {e})")
            raise EngineStepError(failed, f"{type(cause).__name__}: {cause}") from cause

    def _admit_waiting_lora(self) -> None:
        """Admit the LoRA requests whose adapter can get a slot now; those whose admission
        failed go to :attr:`failed_admissions` (the caller reports them)."""
        assert self.lora is not None
        for rid, error in self.lora.admit_waiting():
            self._matchers.pop(rid, None)
            logger.error("LoRA request %s failed on admission: %s", rid, error)
            self.failed_admissions.append((rid, str(error), getattr(error, "param", None)))

    def take_failed_admissions(self) -> list[tuple[str, str, str | None]]:
        """``(request id, message, param)`` of the LoRA requests that waited for a slot and
        then could not be admitted (their adapter could not be read again), since the last
        call."""
        failed, self.failed_admissions = self.failed_admissions, []
        return failed

    def dead_workers(self) -> list[str]:
        """One line per tensor-parallel worker that is gone (empty: all alive, or none)."""
        return [] if self.executor is None else self.executor.dead_workers()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also at interpreter
        exit)."""
        if self.executor is not None:
            self.executor.shutdown()

    def _roll_back(self, batch: ScheduledBatch) -> list[str]:
        """After a failed step: hand ``batch`` back to the scheduler if ``update()`` did not
        take it, and abort every request with a sequence in it (all its samples: KV blocks
        freed, sampling rows dropped). Returns those request ids."""
        seq_ids = batch.seq_ids[:batch.num_seqs].tolist()
        owners = [self._seqs[s][0] if s in self._seqs else self.beams.owner.get(s)
                  for s in seq_ids]
        failed = list(dict.fromkeys(r for r in owners if r is not None))
        if self._pending is batch:
            self._pending = None
            self.scheduler.abort_batch(batch)
        self.abort_requests(failed)
        logger.error("engine step failed; aborted the %d request(s) of its batch: %s",
                     len(failed), failed)
        return failed

    def _run(self, batch: ScheduledBatch) -> EngineCoreOutputs:
        outputs = EngineCoreOutputs(scheduled_time=time.monotonic())
        self._note_scheduled(batch, outputs)
        result = self.runner.execute(batch)
        beam_rows = None
        if result.counts is None:
            tokens = result.token_ids
            if self.beams.requests:
                tokens, beam_rows = self.beams.before_update(batch.sample_seq_ids, result)
            seq_ids, tokens, finish = self.scheduler.update(batch, tokens)
        else:   # a speculative step: one output row per emitted token (see update_spec)
            seq_ids, tokens, finish, index = self.scheduler.update_spec(
                batch, result.token_ids, result.counts)
            self.spec_stats.add(batch.num_draft_tokens, result.counts)
            result = dataclasses.replace(result, token_ids=tokens, counts=None, **{
                name: None if a is None else a.reshape(-1, *a.shape[2:])[index]
                for name, a in (("logprobs", result.logprobs),
                                ("top_token_ids", result.top_token_ids),
                                ("top_logprobs", result.top_logprobs))})
        self._pending = None
        if result.grammar_ended:
            self._end_grammars(result.grammar_ended, seq_ids, finish)
        if beam_rows is not None:   # NOTE: beams report only when their search ends
            keep = ~beam_rows
            seq_ids, tokens, finish = seq_ids[keep], tokens[keep], finish[keep]
            result = result.select(keep)
        # NOTE: plain lists: the message crosses a process boundary, and the API process
        # does not import numpy
        outputs.token_ids, outputs.finish_reasons = tokens.tolist(), finish.tolist()
        outputs.logprobs = _as_list(result.logprobs)
        outputs.top_token_ids = _as_list(result.top_token_ids)
        outputs.top_logprobs = _as_list(result.top_logprobs)
        if result.prompt_logprobs:
            outputs.prompt_logprobs = [
                PromptLogprobs(self._seqs[c.seq_id][0], c.start, c.logprobs.tolist(),
                               c.top_token_ids.tolist(), c.top_logprobs.tolist())
                for c in result.prompt_logprobs]
        self._last_ids, self._last_lens = batch.seq_ids.copy(), batch.seq_lens.copy()
        if result.counts is not None:   # rejected drafts hold no live KV
            rows = np.searchsorted(batch.query_start_loc, batch.sample_rows + 1) - 1
            np.subtract.at(self._last_lens, rows, batch.num_draft_tokens + 1 - result.counts)
        self._last_finished = []
        for sid in seq_ids.tolist():
            rid, index = self._seqs[sid]
            outputs.request_ids.append(rid)
            outputs.sample_indices.append(index)
        for sid in seq_ids[finish != 0].tolist():
            self._finish_seq(sid)
        if beam_rows is not None:
            add_results(outputs, self.beams.after_update())
            self._last_finished += self.beams.freed
            self.beams.freed = []
        self._note_live_tokens()
        return outputs

    def _end_grammars(self, ended: list[int], seq_ids: np.ndarray, finish: np.ndarray) -> None:
        """Finish (``STOPPED``) the still-running sequences whose grammar ended this step."""
        for sid in ended:
            row = np.flatnonzero(seq_ids == sid)
            if len(row) and finish[row[0]] == FinishReason.NONE:
                self.scheduler.finish(sid, int(FinishReason.STOPPED))
                finish[row[0]] = int(FinishReason.STOPPED)

    def _note_scheduled(self, batch: ScheduledBatch, outputs: EngineCoreOutputs) -> None:
        seq_ids = batch.seq_ids
        self._num_steps += 1
        self._peak_seqs = max(self._peak_seqs, len(seq_ids))
        if self._unscheduled:
            for row, sid in enumerate(seq_ids.tolist()):
                if sid in self._unscheduled:
                    outputs.first_scheduled.append(self._unscheduled.pop(sid))
                    # NOTE: a first step starts at the prefix-cache hit (num_computed)
                    start = int(batch.query_start_loc[row])
                    outputs.num_cached_tokens.append(int(batch.positions[start]))

    def _note_live_tokens(self) -> None:
        """Tokens whose K/V the last step's sequences still hold (finished ones freed theirs)."""
        if not self._last_finished:
            self._live_tokens = int(self._last_lens.sum())
            return
        still_running = ~np.isin(self._last_ids, self._last_finished)
        self._live_tokens = int(self._last_lens[still_running].sum())

    # ----------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        """Current load; see :class:`EngineStats`."""
        s = self.scheduler
        usable = s.num_blocks - (s.null_block >= 0)     # a sliding window's null block: never
        used = usable - s.num_free_blocks
        # NOTE: LoRA requests waiting for a device slot wait too (not yet in the scheduler)
        held = 0 if self.lora is None else len(self.lora.waiting)
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting + held,
                           num_free_blocks=s.num_free_blocks, num_blocks=usable,
                           kv_cache_usage=used / usable, num_preemptions=s.num_preemptions,
                           peak_num_seqs_in_step=self._peak_seqs, num_steps=self._num_steps,
                           num_live_tokens=self._live_tokens, block_size=s.block_size,
                           num_cached_tokens_total=s.num_prefix_hit_tokens,
                           num_prefix_query_tokens_total=s.num_prefix_query_tokens,
                           prefix_cache_hit_rate=s.num_prefix_hit_tokens
                           / max(s.num_prefix_query_tokens, 1),
                           spec_decode=self.spec_stats.snapshot(),
                           **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        running, waiting = self.lora.counts()
        return {"lora_running": running, "lora_waiting": waiting,
                "max_loras": self.config.lora_config.max_loras}
