"""AsyncEngine: drive one :class:`LLMEngine` from a background thread for an asyncio server.

Threading model (the event loop never blocks on a model step):

- One engine thread owns the ``LLMEngine``; every engine call (``add_request``,
  ``abort_request``, ``step``, ``get_stats``) happens on it. Other threads send it commands
  through a list guarded by a ``threading.Condition`` and wait on a
  ``concurrent.futures.Future``.
- The thread drains the commands, then runs one ``step()`` while there is work, so requests
  that arrive while others decode join the batch at the next step (continuous batching).
  With no work it sleeps on the condition.
- Each request's cumulative ``RequestOutput`` snapshots go to its ``asyncio.Queue`` through
  ``loop.call_soon_threadsafe``; :class:`RequestStream` is the handler's async iterator.
- Requests arrive already checked by the engine's request gate (``engine.input_processor``,
  called on the caller's thread). A failing ``add_request`` fails only that request's future.
  A failing ``step()`` fails the streams in flight and aborts them; the thread keeps running.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nybble.outputs import RequestOutput

if TYPE_CHECKING:
    from nybble.runtime.engine import LLMEngine
    from nybble.runtime.messages import EngineCoreRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class StepRecord:
    """What one engine step (or an idle check) produced, for metrics observers.

    Attributes:
        outputs: cumulative snapshots of the requests that changed in the step.
        stats: ``engine.get_stats()`` after the step.
        prompt_tokens: prompt tokens of requests that got their first token in the step.
        generation_tokens: tokens generated in the step (all samples of all requests).
        first_token_ids: request ids that got their first token in the step.
        itl: per request with new tokens (after its first), seconds since its previous tokens.
        now: ``time.monotonic()`` at the end of the step (seconds).
    """

    outputs: list[RequestOutput]
    stats: Any
    prompt_tokens: int = 0
    generation_tokens: int = 0
    first_token_ids: list[str] = dataclasses.field(default_factory=list)
    itl: list[float] = dataclasses.field(default_factory=list)
    now: float = 0.0


StepObserver = Callable[[StepRecord], None]


class RequestStream:
    """Async iterator over one request's cumulative :class:`RequestOutput` snapshots.

    It ends after the snapshot with ``finished=True``. If the engine fails while the request
    runs, iteration raises that error.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def push(self, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` to the stream's event loop (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # NOTE: the loop is closed (server shut down); nobody listens
            pass


@dataclasses.dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping of one request (for token counts and ITL)."""

    stream: RequestStream
    num_tokens: int = 0
    last_token_time: float | None = None


class AsyncEngine:
    """Run ``engine.step()`` on a background thread and stream outputs to asyncio handlers.

    Args:
        engine: the engine; after :meth:`start`, only the engine thread touches it.
        observer: called on the engine thread after every step and once when the engine goes
            idle (metrics); must be quick and must not raise.
        log_stats: log a stats line every ``stats_interval_s`` seconds while busy.
        stats_interval_s: seconds between stats lines.
    """

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None,
                 log_stats: bool = True, stats_interval_s: float = 5.0) -> None:
        self.engine = engine
        self.observer = observer
        self.log_stats = log_stats
        self.stats_interval_s = stats_interval_s
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._window = [time.monotonic(), 0, 0]   # start (s), prompt tokens, generation tokens

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nybble-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step (waits up to ``timeout`` seconds)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # ---- API for the event loop -----------------------------------------------------------
    async def add_request(self, request: EngineCoreRequest,
                          prompt: str | None = None) -> RequestStream:
        """Submit a request the engine's gate has processed (``engine.input_processor``, on
        the caller's thread); returns its stream once the engine has accepted it.

        Args:
            request: its ``arrival_time`` is when the HTTP request arrived, so TTFT and queue
                time include tokenization.
            prompt: the prompt's text, if it had one.

        Raises:
            InvalidRequestError: the engine rejected the request (its message is kept).
        """
        request_id = request.request_id
        stream = RequestStream(request_id, asyncio.get_running_loop())

        def add() -> None:
            self.engine.add_core_request(request, prompt)
            self._tracked[request_id] = _Tracked(stream)

        await asyncio.wrap_future(self._submit(add))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its blocks are freed by the engine.

        Safe to call from any thread; does not wait.
        """
        def abort() -> None:
            if self._tracked.pop(request_id, None) is not None:
                try:
                    self.engine.abort_request(request_id)
                except Exception:  # NOTE: nobody waits on this future; log instead
                    logger.exception("abort of %s failed", request_id)

        self._submit(abort)

    async def get_stats(self) -> Any:
        """``engine.get_stats()``, read on the engine thread between steps."""
        return await asyncio.wrap_future(self._submit(self.engine.get_stats))

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cond:
            if self._stop:
                fut.set_exception(RuntimeError("the engine is shut down"))
                return fut
            self._commands.append((fn, fut))
            self._cond.notify()
        return fut

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        idle_reported = False
        while True:
            with self._cond:
                while (not self._stop and not self._commands and idle_reported
                       and not self._has_work()):
                    self._cond.wait()
                if self._stop:
                    break
                commands, self._commands = self._commands, []
            for fn, fut in commands:
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 -- one bad request must not stop the loop
                    fut.set_exception(exc)
            if self._has_work():
                if idle_reported:   # NOTE: busy again: rates count from now, not from idle
                    self._window = [time.monotonic(), 0, 0]
                idle_reported = False
                self._step()
            elif not idle_reported:
                # NOTE: one record after the last step, so gauges return to 0 when idle
                self._notify(StepRecord([], self.engine.get_stats(), now=time.monotonic()))
                idle_reported = True
        self._fail_all(RuntimeError("the engine was shut down"))
        with self._cond:
            commands, self._commands = self._commands, []
        for _, fut in commands:
            fut.set_exception(RuntimeError("the engine was shut down"))

    def _has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_all(exc)
            return
        record = StepRecord([], None, now=time.monotonic())
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:      # aborted meanwhile
                continue
            # NOTE: the engine's RequestOutputs are snapshots (copies), safe to hand over
            self._account(tracked, out, record)
            record.outputs.append(out)
            if out.finished:
                del self._tracked[out.request_id]
            tracked.stream.push(out)
        record.stats = self.engine.get_stats()
        self._notify(record)
        self._maybe_log(record)

    def _account(self, tracked: _Tracked, out: RequestOutput, record: StepRecord) -> None:
        """Count new tokens, first tokens and inter-token gaps of one request's snapshot."""
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        new = num_tokens - tracked.num_tokens
        if new <= 0:
            return
        tracked.num_tokens = num_tokens
        record.generation_tokens += new
        now = (out.metrics.last_token_time if out.metrics is not None
               and out.metrics.last_token_time is not None else record.now)
        if tracked.last_token_time is None:
            record.first_token_ids.append(out.request_id)
            record.prompt_tokens += len(out.prompt_token_ids)
        else:
            record.itl.append(max(0.0, now - tracked.last_token_time))
        tracked.last_token_time = now

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, tracked in list(self._tracked.items()):
            tracked.stream.push(exc)
            try:
                self.engine.abort_request(request_id)
            except Exception:  # NOTE: already failing; keep releasing the others
                logger.exception("abort of %s failed", request_id)
        self._tracked.clear()

    def _notify(self, record: StepRecord) -> None:
        if self.observer is not None:
            try:
                self.observer(record)
            except Exception:  # NOTE: metrics must never take the engine down
                logger.exception("step observer failed")

    def _maybe_log(self, record: StepRecord) -> None:
        self._window[1] += record.prompt_tokens
        self._window[2] += record.generation_tokens
        elapsed = record.now - self._window[0]
        if elapsed < self.stats_interval_s:
            return
        if self.log_stats:
            s = record.stats
            logger.info(
                "running: %d reqs, waiting: %d reqs, prompt throughput: %.1f tokens/s, "
                "generation throughput: %.1f tokens/s, KV cache usage: %.1f%%, "
                "preemptions: %d", s.num_running, s.num_waiting, self._window[1] / elapsed,
                self._window[2] / elapsed, 100.0 * s.kv_cache_usage, s.num_preemptions)
        self._window = [record.now, 0, 0]
