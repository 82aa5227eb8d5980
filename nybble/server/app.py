"""build_app: the FastAPI application around the API process's side of the engine.

The lifespan starts the :class:`AsyncEngine`'s output task when the server starts and, when
it shuts down, ends the requests still in flight and stops the engine-core process; routers
come from ``completions``, ``chat`` and ``routes_misc``.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from nybble.runtime.async_engine import AsyncEngine
from nybble.runtime.input_processor import InputProcessor
from nybble.runtime.tokenizer import Tokenizer
from nybble.server import chat, completions, routes_misc
from nybble.server.config import ServerConfig
from nybble.server.errors import install_error_handlers
from nybble.server.metrics import ServerMetrics
from nybble.server.state import ServerState
from nybble.version import __version__

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, gate: InputProcessor, tokenizer: Tokenizer,
              model_name: str, model_path: str, metrics: ServerMetrics,
              config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app serving ``engine``.

    Args:
        engine: the engine (its core process started and ready).
        gate: the request gate, built from the core's handshake.
        tokenizer: the model's tokenizer.
        model_name: the name the API reports and accepts.
        model_path: the model folder.
        metrics: the Prometheus metrics (the engine's step observer).
        config: server settings (API key, stats interval, ...).
    """
    state = ServerState(engine=engine, input_processor=gate, config=config,
                        model_name=model_name, model_path=model_path, tokenizer=tokenizer,
                        max_model_len=gate.limits.max_model_len, metrics=metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("serving %s at %s/v1 (OpenAI API; also /health, /metrics)",
                    model_name, config.url)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="nybble", version=__version__, lifespan=lifespan)
    app.state.nybble = state
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(routes_misc.v1_router)
    app.include_router(routes_misc.router)
    return app
