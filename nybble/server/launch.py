"""Start-up and shutdown of ``nybble serve``: two processes, one command.

Order (the core's torch import and model load overlap this process's start-up):

1. cheap checks (model folder, tokenizer folder) and binding the port: a bad path or a busy
   port fails at once with one line;
2. start the engine-core process (:func:`spawn_core`), before this process imports anything
   heavier than the argument parser: asyncio, ZeroMQ (:class:`CoreClient`), the web stack;
3. meanwhile import those, load the tokenizer (``tokenizer.json``) and start uvicorn on the
   bound socket: ``/health`` answers 503 and API requests wait until the engine is ready;
4. the core's handshake (KV pool, limits, EOS ids) completes the app (request gate, engine);
   a start-up error in the core stops uvicorn and becomes one :class:`EngineStartupError`
   line (exit code 2 from the CLI).

Signals: the first SIGINT or SIGTERM stops accepting connections and ends every request in
flight at once (streams end with ``finish_reason: "abort"`` and ``[DONE]``, waiting callers get
a 503 JSON error), then the core is stopped and the process exits 0; a second signal kills the
core and exits at once. The core dies with this process in any case (see
:mod:`nybble.runtime.engine.core_process`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from nybble.config import EngineConfig
from nybble.model_files import has_tokenizer_file
from nybble.oslimits import raise_open_file_limit
from nybble.runtime.frontend.core_spawn import spawn_core
from nybble.server.config import ServerConfig

if TYPE_CHECKING:
    from nybble.runtime.frontend.core_client import CoreClient
    from nybble.server.state import Startup

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 3
"""How long uvicorn waits for open connections after the first signal (seconds)."""


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Start the engine core, then serve HTTP on ``server_config.host:port`` until
    SIGINT/SIGTERM.

    Returns:
        The process exit code (0 after a clean shutdown, SIGINT included).

    Raises:
        EngineStartupError: the engine core could not start (one line for the user).
        UnsupportedModelError, ValueError: a bad model or tokenizer folder.
        OSError: the port cannot be bound.
    """
    engine_config.model_config.check_folders()
    raise_open_file_limit(server_config.limit_concurrency + 256)
    # NOTE: bind before starting the core, so a busy port fails at once with one clear line,
    # and the "serving ... at URL" line (logged at app start-up) comes only once it is bound.
    sock = _bind(server_config.host, server_config.port)
    t0 = time.monotonic()
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    core = spawn_core(engine_config, log_level=level)
    # NOTE: imported after the spawn (see the module's docstring)
    import asyncio

    from nybble.runtime.frontend.core_client import CoreClient

    try:
        client = CoreClient(core)
    except BaseException:
        core.proc.kill()
        core.proc.wait()
        raise
    try:
        asyncio.run(_serve(client, sock, engine_config, server_config, t0))
    except KeyboardInterrupt:  # NOTE: Ctrl-C while the model was still loading
        logger.info("interrupted during start-up")
    finally:
        client.close()
    logger.info("server stopped")
    return 0


async def _serve(client: CoreClient, sock: socket.socket, engine_config: EngineConfig,
                 server_config: ServerConfig, t0: float) -> None:
    # NOTE: the web stack is imported here, after the core process started loading
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from nybble.runtime.frontend.async_engine import AsyncEngine
    from nybble.runtime.frontend.input_processor import InputProcessor
    from nybble.tokenizer.tokenizer import Tokenizer
    from nybble.server.app import attach_engine, build_app
    from nybble.server.connections import idle_timeout_protocol
    from nybble.server.generation_defaults import generation_defaults
    from nybble.server.lora_registry import LoRARegistry
    from nybble.server.metrics import ServerMetrics
    from nybble.server.state import ServerState

    mc = engine_config.model_config
    folder = mc.tokenizer_folder
    tokenizer = Tokenizer.from_folder(folder) if has_tokenizer_file(folder) else None
    names = server_config.served_model_names or (mc.name,)
    model_name = names[0]
    metrics = ServerMetrics(model_name)
    app = build_app(server_config, metrics)
    startup = app.state.startup
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.uvicorn_log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            timeout_keep_alive=server_config.timeout_keep_alive_s,
                            limit_concurrency=server_config.limit_concurrency,
                            http=idle_timeout_protocol(server_config.timeout_request_read_s))
    server = _server_class()(config, startup)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    handshake = asyncio.ensure_future(client.wait_ready())
    await asyncio.wait({serving, handshake}, return_when=asyncio.FIRST_COMPLETED)
    if not handshake.done():  # NOTE: stopped (a signal) while the model was loading
        handshake.cancel()
        startup.failed("the server stopped before the engine was ready")
        await serving
        return
    try:
        ready = handshake.result()
    except BaseException as e:
        startup.failed(str(e))
        server.should_exit = True
        await serving
        raise
    if tokenizer is None:  # NOTE: converted by transformers in the core
        tokenizer = Tokenizer.from_folder(folder, ready.tokenizer_json)
    if server_config.chat_template is not None:   # NOTE: --chat-template
        tokenizer.chat_template = server_config.chat_template
    logger.info("engine ready in %.2f s (engine core pid %d, %d torch threads)",
                time.monotonic() - t0, ready.pid, ready.threads)
    engine = AsyncEngine(client, tokenizer, observer=metrics.observe,
                         log_stats=server_config.log_stats,
                         stats_interval_s=server_config.stats_interval_s,
                         max_num_waiting_requests=server_config.max_num_waiting_requests)
    gate = InputProcessor(tokenizer, ready.limits, ready.eos_token_ids)
    lora = None
    if ready.limits.lora is not None:
        lora = LoRARegistry(ready.limits.lora, model_name, names)
        try:
            for name, path, base in server_config.lora_modules:  # NOTE: a bad folder: no server
                lora.check(name, path, base)
                lora.add(name, path, base)
                logger.info("LoRA adapter %s from %s", name, path)
        except ValueError as e:     # NOTE: stop as a failed handshake does
            startup.failed(str(e))
            server.should_exit = True
            await serving
            raise
    attach_engine(app, ServerState(
        engine=engine, input_processor=gate, config=server_config, model_name=model_name,
        model_aliases=names[1:],
        model_path=os.path.basename(os.path.normpath(mc.model)), tokenizer=tokenizer,
        max_model_len=ready.limits.max_model_len, metrics=metrics,
        executor=ThreadPoolExecutor(server_config.api_threads, thread_name_prefix="nybble-api"),
        max_token_chars=tokenizer.max_token_chars,
        sampling_defaults=generation_defaults(server_config.generation_config, mc.model),
        lora=lora))
    await serving


def _server_class() -> type:
    """uvicorn's ``Server`` with nybble's signal handling (a function: uvicorn is imported
    only after the core process started)."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with nybble's signal handling (see the module's docstring)."""

        def __init__(self, config: uvicorn.Config, startup: Startup) -> None:
            super().__init__(config)
            self.nybble_startup = startup

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # NOTE: unlike uvicorn's own handlers, the signal is not re-raised after a
            # graceful shutdown, so it exits 0 without a KeyboardInterrupt traceback
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.on_signal, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def on_signal(self, sig: int) -> None:
            """First signal: graceful shutdown (requests in flight end now); second: exit
            now."""
            name = signal.Signals(sig).name
            state = self.nybble_startup.state
            if self.should_exit:
                logger.warning("%s again: exiting now", name)
                if state is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(state.engine.client.pid, signal.SIGKILL)
                sys.stderr.flush()
                os._exit(128 + sig)
            logger.info("%s: shutting down; ending the requests in flight", name)
            self.should_exit = True
            if state is not None:
                state.engine.begin_shutdown()
            else:
                self.nybble_startup.failed("the server is shutting down")

    return Server


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port``.

    Raises:
        OSError: the address is in use or cannot be bound (message names host and port).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock
