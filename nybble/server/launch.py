"""Start-up and shutdown of ``nybble serve``: two processes, one command.

Order (the core's torch import and model load overlap this process's start-up):

1. cheap checks (model folder, tokenizer folder) and binding the port: a bad path or a busy
   port fails at once with one line;
2. start the engine-core process (:class:`CoreClient`);
3. meanwhile import the web stack and load the tokenizer (``tokenizer.json``);
4. wait for the core's handshake (KV pool, limits, EOS ids); a start-up error in the core
   becomes one :class:`EngineStartupError` line here (exit code 2 from the CLI);
5. build the app and run uvicorn on the bound socket.

Signals: the first SIGINT or SIGTERM stops accepting connections and ends every request in
flight at once (streams end with ``finish_reason: "abort"`` and ``[DONE]``, waiting callers get
a 503 JSON error), then the core is stopped and the process exits 0; a second signal kills the
core and exits at once. The core dies with this process in any case (see
:mod:`nybble.runtime.core_process`).
"""
from __future__ import annotations

import asyncio
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

from nybble.config import EngineConfig, has_tokenizer_file
from nybble.runtime.core_client import CoreClient
from nybble.server.config import ServerConfig

if TYPE_CHECKING:
    from nybble.runtime.async_engine import AsyncEngine

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
    # NOTE: bind before starting the core, so a busy port fails at once with one clear line,
    # and the "serving ... at URL" line (logged at app start-up) comes only once it is bound.
    sock = _bind(server_config.host, server_config.port)
    t0 = time.monotonic()
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    client = CoreClient(engine_config, log_level=level)
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
    import uvicorn

    from nybble.runtime.async_engine import AsyncEngine
    from nybble.runtime.input_processor import InputProcessor
    from nybble.runtime.tokenizer import Tokenizer
    from nybble.server.app import build_app
    from nybble.server.metrics import ServerMetrics

    mc = engine_config.model_config
    folder = mc.tokenizer_folder
    tokenizer = Tokenizer.from_folder(folder) if has_tokenizer_file(folder) else None
    ready = await client.wait_ready()
    if tokenizer is None:  # NOTE: converted by transformers in the core
        tokenizer = Tokenizer.from_folder(folder, ready.tokenizer_json)
    logger.info("engine ready in %.2f s (engine core pid %d, %d torch threads)",
                time.monotonic() - t0, ready.pid, ready.threads)
    model_name = server_config.served_model_name or mc.name
    metrics = ServerMetrics(model_name)
    engine = AsyncEngine(client, tokenizer, observer=metrics.observe,
                         log_stats=server_config.log_stats,
                         stats_interval_s=server_config.stats_interval_s)
    gate = InputProcessor(tokenizer, ready.limits, ready.eos_token_ids)
    app = build_app(engine, gate, tokenizer, model_name, mc.model, metrics, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.uvicorn_log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)

    class Server(uvicorn.Server):
        """uvicorn's server with nybble's signal handling (see the module's docstring)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # NOTE: unlike uvicorn's own handlers, the signal is not re-raised after a
            # graceful shutdown, so it exits 0 without a KeyboardInterrupt traceback
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, _on_signal, self, engine, client, sig)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    await Server(config).serve(sockets=[sock])


def _on_signal(server: object, engine: AsyncEngine, client: CoreClient, sig: int) -> None:
    """First signal: graceful shutdown (requests in flight end now); second: exit now."""
    name = signal.Signals(sig).name
    if getattr(server, "should_exit", False):
        logger.warning("%s again: exiting now", name)
        with contextlib.suppress(ProcessLookupError):
            os.kill(client.pid, signal.SIGKILL)
        sys.stderr.flush()
        os._exit(128 + sig)
    logger.info("%s: shutting down; ending the requests in flight", name)
    server.should_exit = True  # type: ignore[attr-defined]
    engine.begin_shutdown()


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
