"""CoreClient: the API process's handle on the engine-core process.

It takes the process :func:`~nybble.runtime.frontend.core_spawn.spawn_core` started, binds the two
ZeroMQ sockets on the Unix-domain (``ipc://``) paths the core connects to, and then:

- sends :class:`CoreInputs` batches (everything queued during one event-loop turn goes in one
  message: new requests first, then stop-string finishes, then aborts), utility calls and
  :class:`Shutdown` over the PUSH socket (non-blocking, unbounded queue);
- receives the handshake and then every core message on the PULL socket (``recv``);
- watches the process: a ``pidfd`` (Linux) wakes the event loop the moment the core exits,
  a poll every 0.5 s elsewhere; :attr:`exit_code` is set then and the ``on_exit`` callback
  runs.

The core is started first thing (even before this module, asyncio and ZeroMQ are imported:
the core connects only after its torch import, long after the sockets are bound), so it
imports torch and loads the model while this process imports the web stack and loads the
tokenizer.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Callable

import zmq
import zmq.asyncio

from nybble.errors import EngineStartupError
from nybble.runtime.frontend.core_spawn import CoreProcess
from nybble.runtime.messages import (
    Codec,
    CoreInputs,
    EngineCoreReady,
    EngineCoreStartupFailed,
    FromCore,
    Shutdown,
    UtilityCall,
)

logger = logging.getLogger(__name__)

_EXIT_POLL_S = 0.5


class CoreClient:
    """Talk to the engine-core process and watch it (one per ``nybble serve``).

    Args:
        core: the process :func:`~nybble.runtime.frontend.core_spawn.spawn_core` started (this
        client
            owns it from now on: :meth:`close` kills it if it still runs).

    Raises:
        zmq.ZMQError: a socket could not be bound (the caller kills ``core.proc``).
    """

    def __init__(self, core: CoreProcess) -> None:
        self.proc = core.proc
        self._dir = core.folder
        self._noblock = zmq.NOBLOCK
        self._ctx = zmq.asyncio.Context()
        # NOTE: a plain socket for sending, so callers need not await (PUSH never blocks
        # with an unbounded queue); an asyncio socket for receiving
        self._input = zmq.Socket(self._ctx, zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(core.input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(core.output_address)
        self._codec = Codec(FromCore)
        self.exit_code: int | None = None
        self.on_exit: Callable[[int], None] | None = None
        self._exit_event: asyncio.Event | None = None
        self._watch: asyncio.Task[None] | None = None
        self._call_id = 0
        self._pending = CoreInputs()
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int:
        """The core's process id."""
        return int(self.proc.pid)

    @property
    def alive(self) -> bool:
        """Whether the core process is still running (as far as the watcher knows)."""
        return self.exit_code is None

    # ------------------------------------------------------------------ lifecycle
    def watch(self) -> None:
        """Start watching the process on the running event loop (idempotent)."""
        if self._exit_event is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._exit_event = asyncio.Event()
        try:
            fd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # NOTE: not Linux >= 5.3: poll instead
            self._watch = asyncio.create_task(self._poll_exit())
            return
        self._loop.add_reader(fd, self._on_pidfd, fd)

    def _on_pidfd(self, fd: int) -> None:
        assert self._loop is not None
        self._loop.remove_reader(fd)
        os.close(fd)
        self._exited()

    async def _poll_exit(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(_EXIT_POLL_S)
        self._exited()

    def _exited(self) -> None:
        code = self.proc.wait()
        if self.exit_code is not None:
            return
        self.exit_code = code
        assert self._exit_event is not None
        self._exit_event.set()
        if self.on_exit is not None:
            self.on_exit(code)

    async def wait_ready(self) -> EngineCoreReady:
        """The core's handshake.

        Raises:
            EngineStartupError: the core reported a start-up failure or exited before the
                handshake (its log says more).
        """
        self.watch()
        assert self._exit_event is not None
        recv = asyncio.ensure_future(self._output.recv())
        died = asyncio.ensure_future(self._exit_event.wait())
        try:
            await asyncio.wait({recv, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
        if not recv.done():
            recv.cancel()
            raise EngineStartupError(f"the engine core exited with code {self.exit_code} "
                                     f"before it was ready (see the log above)")
        msg = self._codec.decode(recv.result())
        if isinstance(msg, EngineCoreStartupFailed):
            raise EngineStartupError(msg.message)
        if not isinstance(msg, EngineCoreReady):
            raise EngineStartupError(f"the engine core sent {type(msg).__name__} before its "
                                     f"handshake")
        return msg

    async def shutdown(self, timeout_s: float = 2.0) -> None:
        """Ask the core to exit; terminate (then kill) it if it has not within ``timeout_s``;
        close the sockets and remove the socket folder."""
        if self.alive:
            self._send(Shutdown())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wait_exit(), timeout_s)
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wait_exit(), 1.0)
        self.close()

    async def _wait_exit(self) -> None:
        if self._exit_event is None:
            while self.proc.poll() is None:
                await asyncio.sleep(0.05)
            return
        await self._exit_event.wait()

    def close(self) -> None:
        """Kill the core if it still runs, close the sockets, remove the socket folder
        (safe to call more than once, from anywhere)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ messages
    def add_request(self, request: object) -> None:
        """Queue a new request (sent at the end of this event-loop turn)."""
        self._pending.adds.append(request)  # type: ignore[arg-type]
        self._schedule_flush()

    def finish_sample(self, request_id: str, index: int) -> None:
        """Queue the stop-string finish of one sample."""
        self._pending.finishes.append((request_id, index))
        self._schedule_flush()

    def abort(self, request_id: str) -> None:
        """Queue an abort."""
        self._pending.aborts.append(request_id)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what is queued now, as one :class:`CoreInputs` message."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, CoreInputs()
        if (pending.adds or pending.finishes or pending.aborts) and self.alive:
            self._send(pending)

    def call(self, method: str) -> int:
        """Send a :class:`UtilityCall`; returns its call id (the result arrives by
        :meth:`recv`)."""
        self.flush()  # NOTE: the answer then reflects everything sent before it
        self._call_id += 1
        self._send(UtilityCall(self._call_id, method))
        return self._call_id

    def _send(self, message: object) -> None:
        self._input.send(self._codec.encode(message), flags=self._noblock)  # type: ignore[arg-type]

    async def recv(self) -> object:
        """The next message from the core."""
        return self._codec.decode(await self._output.recv())
