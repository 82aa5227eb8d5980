"""build_app: the FastAPI application around one engine.

The lifespan starts the :class:`AsyncEngine` thread when the server starts and stops it when
the server shuts down; routers come from ``completions``, ``chat`` and ``routes_misc``.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

import nybble
from nybble.runtime.async_engine import AsyncEngine
from nybble.server import chat, completions, routes_misc
from nybble.server.config import ServerConfig
from nybble.server.errors import install_error_handlers
from nybble.server.metrics import ServerMetrics
from nybble.server.state import ServerState

if TYPE_CHECKING:
    from nybble.runtime.engine import LLMEngine

logger = logging.getLogger(__name__)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app serving ``engine``.

    Args:
        engine: a ready engine; from now on only the app's engine thread calls it.
        config: server settings (model name, API key, stats interval, ...).
    """
    model_name = config.served_model_name or engine.model_name
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, observer=metrics.observe, log_stats=config.log_stats,
                               stats_interval_s=config.stats_interval_s)
    state = ServerState(engine=async_engine, input_processor=engine.input_processor,
                        config=config, model_name=model_name,
                        model_path=engine.config.model_config.model,
                        tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                        metrics=metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s at %s/v1 (OpenAI API; also /health, /metrics)",
                    model_name, config.url)
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="nybble", version=nybble.__version__, lifespan=lifespan)
    app.state.nybble = state
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(routes_misc.v1_router)
    app.include_router(routes_misc.router)
    return app
