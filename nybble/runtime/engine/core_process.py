"""The engine-core process of ``nybble serve``: an :class:`EngineCore` behind ZeroMQ sockets.

Started by :func:`nybble.runtime.frontend.core_spawn.spawn_core` (then driven by a
:class:`~nybble.runtime.frontend.core_client.CoreClient`) as
``python -m nybble.runtime.engine.core_process``. It

1. ties its life to its parent: ``PR_SET_PDEATHSIG`` (Linux) kills it when the parent dies,
   and the busy loop checks every second that its parent is still the one that started it
   (the backstop where prctl is missing, or if the parent died before prctl was set);
2. sets the OpenMP thread environment, then imports torch and loads the model (with the
   garbage collector paused, :mod:`nybble.startup_gc`);
3. answers with the handshake (:class:`EngineCoreReady`, or :class:`EngineCoreStartupFailed`
   with one line for the user);
4. runs the busy loop: drain the input socket (every queued message, each possibly a batch),
   run one step, send ONE :class:`EngineCoreOutputs` with every sampled row of the step.
   With no work it blocks on the socket (waking once a second for the parent check).

A step that raises fails only the requests of its batch (the engine core rolls them back,
see :meth:`EngineCore.step`; they are reported with :class:`RequestsFailed`) and the loop
goes on; after :data:`MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row, or at once when
the core's own bookkeeping fails (``schedule()`` or the rollback), the core fails what it
still holds, reports :class:`EngineCoreFatal` and exits, so the API process turns unhealthy.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import zmq

from nybble.config import decode_config
from nybble.errors import (
    EngineStepError,
    InvalidRequestError,
    NybbleError,
    WorkerFailedError,
)
from nybble.model_files import has_tokenizer_file
from nybble.runtime.messages import (
    Codec,
    CoreInputs,
    EngineCoreFatal,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreStartupFailed,
    RequestsFailed,
    Shutdown,
    ToCore,
    UtilityCall,
    UtilityResult,
)
from nybble.runtime.worker.torch_threads import apply_torch_threads
from nybble.oslimits import die_with_parent
from nybble.startup_gc import startup_gc_paused
from nybble.threads import resolve_threads, set_thread_env

if TYPE_CHECKING:
    from nybble.runtime.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
"""How long the idle core blocks on its socket before checking on its parent (ms)."""
PARENT_CHECK_S = 1.0
"""How often the busy core checks that its parent is alive (seconds)."""
MAX_CONSECUTIVE_STEP_FAILURES = 3
"""Failed steps in a row after which the core gives up (the API process reports 503)."""
class CoreProc:
    """The busy loop around one :class:`EngineCore` (see the module's docstring).

    Args:
        core: the loaded engine core.
        inputs: PULL socket (messages from the API process).
        outputs: PUSH socket (messages to the API process).
        parent_pid: the API process; the loop exits when it is gone.
    """

    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket,
                 parent_pid: int) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.codec = Codec(ToCore)
        self._stop = False
        self._failures = 0
        self._idle_reported = True
        self._parent_checked = time.monotonic()
        self._workers_due = False

    def send(self, message: object) -> None:
        """Encode and push one message to the API process."""
        self.outputs.send(self.codec.encode(message))  # NOTE: small: copying beats zero-copy

    def run(self) -> int:
        """Serve until :class:`Shutdown`, the parent's death or a fatal failure; returns the
        process exit code."""
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        while not self._stop:
            busy = self.core.has_unfinished_requests()
            if not busy and poller.poll(IDLE_POLL_MS):
                busy = True  # NOTE: a message arrived; drain it below
            self._drain()
            if not self._parent_alive():
                logger.warning("the API process (pid %d) is gone; engine core exiting",
                               self.parent_pid)
                return 1
            dead = self._dead_workers()
            if dead:    # NOTE: found while idle too, so /health turns 503 at once
                self._give_up(f"WorkerFailedError: tensor-parallel worker failed: {dead}")
                return 1
            if self._stop:
                break
            if self.core.has_unfinished_requests():
                if not self._step():
                    return 1
            elif not self._idle_reported:
                # NOTE: one message after the last step, so the gauges read 0 when idle
                self.send(EngineCoreOutputs(stats=self.core.get_stats()))
                self._idle_reported = True
        return 0

    def _parent_alive(self) -> bool:
        now = time.monotonic()
        if now - self._parent_checked < PARENT_CHECK_S:
            return True
        self._parent_checked = now
        self._workers_due = True
        return os.getppid() == self.parent_pid

    def _dead_workers(self) -> str:
        """``"; "``-joined lines of the tensor-parallel workers that are gone (checked once
        per parent check; empty when all are alive or there are none)."""
        if not self._workers_due:
            return ""
        self._workers_due = False
        return "; ".join(self.core.dead_workers())

    def _drain(self) -> None:
        """Handle every message queued on the input socket, without blocking."""
        while True:
            try:
                data = self.inputs.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.codec.decode(data.buffer))

    def _handle(self, msg: object) -> None:
        if isinstance(msg, CoreInputs):
            for request in msg.adds:
                try:
                    self.core.add_request(request)
                except InvalidRequestError as e:  # NOTE: a grammar that does not compile
                    self.send(RequestsFailed([request.request_id], str(e), param=e.param))
                except Exception as e:  # NOTE: the gate checked it: a bug; fail it
                    logger.exception("add_request(%s) failed", request.request_id)
                    self.send(RequestsFailed([request.request_id], _one_line(e)))
            if msg.finishes:
                self.core.stop_samples(msg.finishes)
            if msg.aborts:
                self.core.abort_requests(msg.aborts)
        elif isinstance(msg, UtilityCall):
            if msg.method == "get_stats":
                self.send(UtilityResult(msg.call_id, result=self.core.get_stats()))
            else:
                self.send(UtilityResult(msg.call_id, error=f"method must be get_stats, "
                                                           f"got {msg.method!r}"))
        elif isinstance(msg, Shutdown):
            self._stop = True

    def _step(self) -> bool:
        """One step, its outputs sent; ``False`` when the core must give up."""
        self._idle_reported = False
        try:
            outputs = self.core.step()
        except EngineStepError as e:  # NOTE: its batch's requests were rolled back
            self._failures += 1
            cause = _one_line(e.__cause__ or e)
            logger.error("engine step failed (%d in a row): %s; failed its %d request(s)",
                         self._failures, cause, len(e.request_ids), exc_info=e.__cause__)
            self.send(RequestsFailed(e.request_ids, f"the engine step failed: {cause}"))
            if isinstance(e.__cause__, WorkerFailedError):   # NOTE: cannot step again
                return self._give_up(cause)
            if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                return self._give_up(f"{self._failures} engine steps failed in a row; "
                                     f"last: {cause}")
            return True
        except Exception as e:  # NOTE: schedule() or the rollback: the state is unknown
            logger.exception("the engine core's bookkeeping failed")
            return self._give_up(f"the engine core's bookkeeping failed: {_one_line(e)}")
        self._failures = 0
        for rid, message, param in self.core.take_failed_admissions():
            self.send(RequestsFailed([rid], message, param=param))
        if outputs is not None:
            outputs.stats = self.core.get_stats()
            self.send(outputs)
        return True

    def _give_up(self, why: str) -> bool:
        """Fail every request still in the core and report :class:`EngineCoreFatal`."""
        ids = self.core.request_ids()
        if ids:
            self.send(RequestsFailed(ids, f"the engine can no longer step: {why}"))
        self.send(EngineCoreFatal(why))
        return False


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nybble.runtime.engine.core_process",
                                description="nybble's engine-core process (started by "
                                            "`nybble serve`, not by hand).")
    p.add_argument("--input-address", required=True, help="ZeroMQ address to PULL from")
    p.add_argument("--output-address", required=True, help="ZeroMQ address to PUSH to")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the engine-core process; returns its exit code (2: a start-up error the user can
    fix, reported in the handshake)."""
    args = _parse_args(argv)
    die_with_parent(args.parent_pid)
    # NOTE: the API process owns the shutdown; a terminal's Ctrl-C must not kill us first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    ctx = zmq.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 10)  # NOTE: ms; if we ever connect before the bind
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(args.input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(args.output_address)
    codec = Codec(ToCore)
    try:
        core, ready = _start(args.config)
    except (NybbleError, ValueError, OSError) as e:
        outputs.send(codec.encode(EngineCoreStartupFailed(str(e), user_error=True)))
        return _close(ctx, 2)
    except Exception as e:  # NOTE: a crash: the log has the traceback
        logger.exception("engine core failed to start")
        outputs.send(codec.encode(EngineCoreStartupFailed(
            f"the engine core failed to start: {_one_line(e)}", user_error=False)))
        return _close(ctx, 1)
    outputs.send(codec.encode(ready))
    code = CoreProc(core, inputs, outputs, args.parent_pid).run()
    core.shutdown()     # NOTE: tensor-parallel workers get STOP (os._exit skips atexit)
    return _close(ctx, code)


def _start(config_json: str) -> tuple[EngineCore, EngineCoreReady]:
    """Threads, imports, model, tokenizer conversion: everything before the handshake (with
    the garbage collector paused, see :mod:`nybble.startup_gc`)."""
    with startup_gc_paused():
        return _load(config_json)


def _load(config_json: str) -> tuple[EngineCore, EngineCoreReady]:
    config = decode_config(config_json)
    threads, source = resolve_threads(config.threads)
    set_thread_env(threads)  # NOTE: before torch is imported (next line)
    from nybble.runtime.engine.engine_core import EngineCore

    apply_torch_threads(threads, source)
    core = EngineCore(config)
    if os.environ.get("NYBBLE_TEST_FAULTS"):  # NOTE: the reliability tests only
        from nybble.runtime.engine.fault_injection import FAULTS_ENV, install_faults

        install_faults(core, os.environ[FAULTS_ENV])
        logger.warning("test fault injection is on: %s=%s", FAULTS_ENV, os.environ[FAULTS_ENV])
    folder = config.model_config.tokenizer_folder
    tokenizer_json = None
    if not has_tokenizer_file(folder):
        from nybble.tokenizer.hf_tokenizer import fast_tokenizer_json

        tokenizer_json = fast_tokenizer_json(folder)
    ready = EngineCoreReady(limits=core.request_limits(),
                            eos_token_ids=list(core.loaded.eos_token_ids),
                            tokenizer_json=tokenizer_json, threads=threads, pid=os.getpid())
    return core, ready


def _close(ctx: zmq.Context, code: int) -> int:
    # NOTE: linger so a last message (handshake failure, fatal) still leaves the socket
    ctx.destroy(linger=2000)
    return code


if __name__ == "__main__":
    exit_code = main()
    # NOTE: skip the interpreter's teardown (torch's is slow): the sockets are closed and
    # nothing else holds state worth flushing but the log
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
