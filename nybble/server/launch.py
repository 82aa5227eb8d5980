"""Start-up: build the engine, log what was loaded, run uvicorn until interrupted."""
from __future__ import annotations

import logging
import socket
import time

import uvicorn

from nybble.config import EngineConfig
from nybble.server.app import build_app
from nybble.server.config import ServerConfig

logger = logging.getLogger(__name__)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the model, then serve HTTP on ``server_config.host:port`` until SIGINT/SIGTERM.

    Returns:
        The process exit code (0 after a clean shutdown, SIGINT included).
    """
    from nybble.runtime.engine import LLMEngine

    # NOTE: bind before loading the model, so a busy port fails at once with one clear line,
    # and the "serving ... at URL" line (logged at app start-up) comes only once it is bound.
    sock = _bind(server_config.host, server_config.port)
    t0 = time.monotonic()
    engine = LLMEngine(engine_config)
    # NOTE: the engine logs the model, dtype, KV blocks and their bytes itself
    logger.info("engine ready in %.2f s", time.monotonic() - t0)
    app = build_app(engine, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.uvicorn_log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        # NOTE: uvicorn shuts down gracefully on SIGINT, then re-raises the signal
        logger.info("server stopped")
    return 0


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
