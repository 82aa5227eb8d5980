"""AsyncEngine: the API process's side of the engine, on the server's event loop.

The engine core (scheduler, model runner, busy loop) runs in its own process
(:mod:`nybble.runtime.engine.core_process`); this object is everything the API process keeps:

- the output side (:class:`OutputProcessor`: detokenizer, stop strings, DELTA
  :class:`RequestOutput` objects) and one :class:`RequestStream` per request, which holds at
  most one unread output: a delta pushed while the previous one is unread is merged into it,
  so a slow reader costs memory linear in its output, not a queue of copies;
- admission control: with ``max_num_waiting_requests``, new requests are refused
  (:class:`EngineOverloadedError`, HTTP 503 with ``Retry-After``) while that many requests
  wait for their first step;
- an output task that receives the core's messages (:class:`CoreClient`): each step's
  :class:`EngineCoreOutputs` is detokenized and pushed to the streams, a stop-string match
  goes back to the core as a finish (vLLM V1 does the same with an abort), and a
  :class:`StepRecord` goes to the metrics observer;
- health: when the core process exits (or reports that it can no longer step) every request
  in flight gets :class:`EngineDeadError`, and so does every new one;
- graceful shutdown: :meth:`begin_shutdown` refuses new requests and ends every request in
  flight at once, as aborted (streams end with ``finish_reason: "abort"``; a caller waiting
  for a whole response gets :class:`EngineShutdownError`).

Requests arrive already checked by the request gate (``InputProcessor``, run by the caller in
this process). Everything here runs on the event loop's thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from nybble.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    EngineShutdownError,
    InvalidRequestError,
    NybbleError,
)
from nybble.outputs import RequestOutput
from nybble.runtime.frontend.core_client import CoreClient
from nybble.runtime.messages import (
    EngineCoreFatal,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    RequestsFailed,
    SpecDecodeStats,
    UtilityResult,
)
from nybble.runtime.frontend.output_processor import OutputProcessor
from nybble.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class StepRecord:
    """What one engine step (or the core going idle) produced, for metrics observers.

    Attributes:
        outputs: delta outputs of the requests that changed in the step (or the final
            output of a request that was aborted or failed).
        stats: the core's counters after the step.
        prompt_tokens: prompt tokens of requests that got their first token in the step.
        generation_tokens: tokens generated in the step (all samples of all requests).
        first_token_ids: request ids that got their first token in the step.
        itl: per request with new tokens (after its first), seconds since its previous tokens.
        now: ``time.monotonic()`` when the step's outputs were processed (seconds).
        aborted: requests ended by an abort (client gone, shutdown) since the last record.
        failed: requests the engine failed since the last record.
    """

    outputs: list[RequestOutput]
    stats: EngineStats | None
    prompt_tokens: int = 0
    generation_tokens: int = 0
    first_token_ids: list[str] = dataclasses.field(default_factory=list)
    itl: list[float] = dataclasses.field(default_factory=list)
    now: float = 0.0
    aborted: int = 0
    failed: int = 0


StepObserver = Callable[[StepRecord], None]


class RequestStream:
    """Async iterator over one request's DELTA :class:`RequestOutput` objects.

    It ends after the output with ``finished=True``. If the engine fails the request,
    iteration raises that error. :attr:`error` is set when the request was ended from outside
    (server shutdown): its last output is an ``"abort"``, and a caller that needs a whole
    response raises :attr:`error` instead.

    NOTE: bounded: it holds at most one unread output (later deltas are merged into it with
    :meth:`RequestOutput.add`) and one error.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False                      # the reader has seen the end
        self.error: NybbleError | None = None
        self.num_tokens = 0                        # tokens seen so far (all samples)
        self.last_token_time: float | None = None
        self._unread: RequestOutput | None = None
        self._raise: BaseException | None = None
        self._wake = asyncio.Event()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._unread is None and self._raise is None:
            self._wake.clear()
            await self._wake.wait()
        if self._unread is not None:
            out, self._unread = self._unread, None
            self.finished = out.finished
            return out
        self.finished = True
        raise self._raise  # type: ignore[misc]

    def push(self, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` to the stream's reader (merged into an unread output)."""
        if isinstance(item, BaseException):
            self._raise = item
        elif self._unread is None:
            self._unread = item
        else:
            self._unread.add(item)
        self._wake.set()


class AsyncEngine:
    """The engine as the server sees it (see the module's docstring).

    Args:
        client: the started engine-core process.
        tokenizer: the model's tokenizer (detokenization).
        observer: called after every step and when the core goes idle (metrics); must be
            quick and must not raise.
        log_stats: log a stats line every ``stats_interval_s`` seconds while busy.
        stats_interval_s: seconds between stats lines.
        max_num_waiting_requests: admission control: refuse new requests while this many
            wait for their first step (``None``: no limit).
    """

    def __init__(self, client: CoreClient, tokenizer: Tokenizer,
                 observer: StepObserver | None = None, log_stats: bool = True,
                 stats_interval_s: float = 5.0,
                 max_num_waiting_requests: int | None = None) -> None:
        self.client = client
        self.output_processor = OutputProcessor(tokenizer, delta=True)
        self.max_num_waiting_requests = max_num_waiting_requests
        self._waiting: set[str] = set()        # submitted, not yet in a scheduled batch
        self.observer = observer
        self.log_stats = log_stats
        self.stats_interval_s = stats_interval_s
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self._dead: str | None = None          # why the engine is dead, once it is
        self._closing = False
        # start (s; None while idle), prompt tokens, generation tokens of the stats line
        self._window: list[Any] = [None, 0, 0]
        self._spec_seen: SpecDecodeStats | None = None   # counters at the last log line

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the output task on the running loop (idempotent)."""
        if self._task is None:
            self.client.on_exit = self._on_core_exit
            self.client.watch()
            self._task = asyncio.create_task(self._output_loop(), name="nybble-outputs")

    async def shutdown(self) -> None:
        """End every request (:meth:`begin_shutdown`) and stop the core process."""
        self.begin_shutdown()
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self.client.shutdown()

    def begin_shutdown(self) -> None:
        """Refuse new requests; end every request in flight now (idempotent).

        Streams get a last snapshot whose unfinished samples end with ``"abort"``; their
        :attr:`RequestStream.error` says why. The core is told to drop them.
        """
        if self._closing:
            return
        self._closing = True
        for request_id, stream in list(self._streams.items()):
            final = self.output_processor.abort_request(request_id)
            stream.error = EngineShutdownError("the server is shutting down; the request was "
                                               "aborted")
            stream.push(final if final is not None else stream.error)
            self.client.abort(request_id)
        self._ended(aborted=len(self._streams))
        self._streams.clear()
        self._waiting.clear()
        self.client.flush()

    @property
    def is_healthy(self) -> bool:
        """Whether the engine core is alive and able to step (``/health``)."""
        return self._dead is None and self.client.alive

    @property
    def is_running(self) -> bool:
        """Healthy and not shutting down."""
        return self.is_healthy and not self._closing

    # ---- API for the handlers --------------------------------------------------------------
    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closing:
            raise EngineShutdownError("the server is shutting down")

    async def add_request(self, request: EngineCoreRequest,
                          prompt: str | None = None) -> RequestStream:
        """Submit a request the gate has processed; returns its stream.

        Args:
            request: its ``arrival_time`` is when the HTTP request arrived, so TTFT and queue
                time include tokenization.
            prompt: the prompt's text, if it had one.

        Raises:
            InvalidRequestError: the request id is already in flight.
            EngineDeadError: the engine core is gone.
            EngineShutdownError: the server is shutting down.
        """
        return self.add_requests([request], [prompt])[0]

    @property
    def num_waiting(self) -> int:
        """Requests submitted that have not been in a scheduled batch yet."""
        return len(self._waiting)

    def add_requests(self, requests: list[EngineCoreRequest],
                     prompts: list[str | None]) -> list[RequestStream]:
        """Submit several gated requests at once (one message to the core); all or none.

        Raises:
            InvalidRequestError, EngineDeadError, EngineShutdownError: as
                :meth:`add_request`; nothing is submitted then.
            EngineOverloadedError: ``max_num_waiting_requests`` requests already wait (a
                request with more prompts than that is admitted only when none waits).
        """
        self._check_open()
        limit = self.max_num_waiting_requests
        if limit is not None and self._waiting and len(self._waiting) + len(requests) > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {len(self._waiting)} requests are waiting for the "
                f"engine (max_num_waiting_requests {limit}); retry later")
        seen: set[str] = set()
        for r in requests:
            self.output_processor.check_new(r.request_id)
            if r.request_id in seen:
                raise InvalidRequestError(f"request_id must be unique, got {r.request_id!r} "
                                          f"twice")
            seen.add(r.request_id)
        streams = []
        for request, prompt in zip(requests, prompts):
            self.output_processor.add_request(request, prompt)
            stream = RequestStream(request.request_id)
            self._streams[request.request_id] = stream
            self._waiting.add(request.request_id)
            streams.append(stream)
            self.client.add_request(request)
        return streams

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); the core frees its KV blocks."""
        if self._streams.pop(request_id, None) is None:
            return
        self._waiting.discard(request_id)
        self.output_processor.abort_request(request_id)
        if self.client.alive:
            self.client.abort(request_id)
        self._ended(aborted=1)

    async def get_stats(self) -> EngineStats:
        """The core's counters, read between two of its steps (after everything sent
        before this call was applied).

        Raises:
            EngineDeadError: the engine core is gone.
        """
        if self._dead is not None or not self.client.alive:
            raise EngineDeadError(self._dead or "the engine core is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[self.client.call("get_stats")] = future
        result: EngineStats = await future
        return result

    # ---- output task -----------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            msg = await self.client.recv()
            try:
                self._dispatch(msg)
            except Exception:  # NOTE: keep serving; fail what was in flight
                logger.exception("processing the engine core's %s failed", type(msg).__name__)
                self._fail(list(self._streams), EngineRequestError,
                           "internal error while processing the engine's outputs")

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, EngineCoreOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, UtilityResult):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():  # NOTE: its caller may be gone
                if msg.error is not None:
                    future.set_exception(EngineRequestError(msg.error))
                else:
                    future.set_result(msg.result)
        elif isinstance(msg, RequestsFailed):
            if msg.param is not None:   # NOTE: the core refused the request: a 400
                self._fail(msg.request_ids, partial(InvalidRequestError, param=msg.param),
                           msg.message)
            else:
                self._fail(msg.request_ids, EngineRequestError, msg.message)
        elif isinstance(msg, EngineCoreFatal):
            logger.error("the engine core can no longer step: %s", msg.message)
            self._mark_dead(f"the engine can no longer step: {msg.message}")

    def _on_outputs(self, core: EngineCoreOutputs) -> None:
        record = StepRecord([], core.stats, now=time.monotonic())
        for rid in core.first_scheduled:
            self._waiting.discard(rid)
        if core.request_ids:
            outputs, stopped = self.output_processor.process_outputs(core)
            for rid, index in stopped:
                self.client.finish_sample(rid, index)
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                self._account(stream, out, record)
                record.outputs.append(out)
                if out.finished:
                    del self._streams[out.request_id]
                    self._waiting.discard(out.request_id)
                stream.push(out)
        self._notify(record)
        if record.outputs:
            self._maybe_log(record)
        else:   # NOTE: the core went idle: rates count from its next busy period
            self._window = [None, 0, 0]

    def _account(self, stream: RequestStream, out: RequestOutput, record: StepRecord) -> None:
        """Count new tokens, first tokens and inter-token gaps of one request's delta."""
        new = sum(len(o.token_ids) for o in out.outputs)
        if new <= 0:
            return
        stream.num_tokens += new
        record.generation_tokens += new
        now = (out.metrics.last_token_time if out.metrics is not None
               and out.metrics.last_token_time is not None else record.now)
        if stream.last_token_time is None:
            record.first_token_ids.append(out.request_id)
            record.prompt_tokens += len(out.prompt_token_ids)
        else:
            record.itl.append(max(0.0, now - stream.last_token_time))
        stream.last_token_time = now

    # ---- failures --------------------------------------------------------------------------
    def _fail(self, request_ids: Iterable[str], error: Callable[[str], NybbleError],
              message: str) -> None:
        """End ``request_ids`` with a fresh ``error(message)`` each (one clean error per
        request, no shared traceback)."""
        failed = 0
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            self._waiting.discard(rid)
            self.output_processor.abort_request(rid)
            if stream is not None:
                stream.push(error(message))
                failed += 1
            if self.client.alive:
                self.client.abort(rid)
        self._ended(failed=failed)

    def _on_core_exit(self, code: int) -> None:
        if not self._closing:
            logger.error("the engine core process exited with code %d", code)
        self._mark_dead(f"the engine core process exited (code {code})")

    def _mark_dead(self, why: str) -> None:
        if self._dead is not None:
            return
        self._dead = why
        if not self._closing:
            self._fail(list(self._streams), EngineDeadError, why)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(why))
        self._calls.clear()

    def _ended(self, aborted: int = 0, failed: int = 0) -> None:
        """Tell the observer about requests that ended without finishing (metrics)."""
        if aborted or failed:
            self._notify(StepRecord([], None, now=time.monotonic(), aborted=aborted,
                                    failed=failed))

    def _notify(self, record: StepRecord) -> None:
        if self.observer is not None:
            try:
                self.observer(record)
            except Exception:  # NOTE: metrics must never take the engine down
                logger.exception("step observer failed")

    def _maybe_log(self, record: StepRecord) -> None:
        """Accumulate ``record`` into the stats line's window; log and restart the window
        once it spans ``stats_interval_s`` (the window opens at the first busy step after an
        idle period, so an idle gap never dilutes the rates)."""
        if self._window[0] is None:
            self._window = [record.now, 0, 0]
            return
        self._window[1] += record.prompt_tokens
        self._window[2] += record.generation_tokens
        elapsed = record.now - self._window[0]
        if elapsed < self.stats_interval_s:
            return
        if self.log_stats and record.stats is not None:
            s = record.stats
            logger.info(
                "running: %d reqs, waiting: %d reqs, prompt throughput: %.1f tokens/s, "
                "generation throughput: %.1f tokens/s, KV cache usage: %.1f%%, "
                "preemptions: %d", s.num_running, s.num_waiting, self._window[1] / elapsed,
                self._window[2] / elapsed, 100.0 * s.kv_cache_usage, s.num_preemptions)
            if s.spec_decode is not None:
                self._log_spec_decode(s.spec_decode)
        self._window = [record.now, 0, 0]

    def _log_spec_decode(self, spec: SpecDecodeStats) -> None:
        """The speculative decoding line: acceptance over the last interval."""
        prev, self._spec_seen = self._spec_seen, spec
        drafted = spec.num_draft_tokens - (prev.num_draft_tokens if prev else 0)
        accepted = spec.num_accepted_tokens - (prev.num_accepted_tokens if prev else 0)
        drafts = spec.num_drafts - (prev.num_drafts if prev else 0)
        if drafts:
            logger.info("speculative decoding: acceptance rate %.1f%%, mean acceptance "
                        "length %.2f tokens, drafted %d tokens, accepted %d tokens",
                        100.0 * accepted / max(drafted, 1), 1 + accepted / drafts, drafted,
                        accepted)
