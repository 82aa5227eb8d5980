"""Start-up: build the engine, log what was loaded, run uvicorn until interrupted."""
from __future__ import annotations

import logging
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

    t0 = time.monotonic()
    engine = LLMEngine(engine_config)
    # NOTE: the engine logs the model, dtype, KV blocks and their bytes itself
    logger.info("engine ready in %.2f s", time.monotonic() - t0)
    app = build_app(engine, server_config)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=server_config.uvicorn_log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        # NOTE: uvicorn shuts down gracefully on SIGINT, then re-raises the signal
        logger.info("server stopped")
    return 0
