"""build_app: the FastAPI application; it serves before the engine is ready.

``nybble serve`` starts HTTP while the engine core still loads; :class:`Startup` (on
``app.state.startup``) holds the requests that need the engine until the handshake arrived
and :func:`attach_engine` made the :class:`ServerState`. The lifespan's shutdown ends the
requests still in flight and stops the engine-core process. Routers come from
``completions``, ``chat`` and ``routes_misc``; the request body limit and the 500 answers
from ``middleware``; the OpenAPI document from ``openapi``.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from nybble.server import chat, completions, lora_routes, routes_misc
from nybble.server.config import ServerConfig
from nybble.server.errors import install_error_handlers
from nybble.server.metrics import ServerMetrics
from nybble.server.middleware import (
    BodyLimitMiddleware,
    InternalErrorMiddleware,
    RequestIdMiddleware,
)
from nybble.server.openapi import install_openapi
from nybble.server.state import ServerState, Startup
from nybble.version import __version__

logger = logging.getLogger(__name__)


def build_app(config: ServerConfig, metrics: ServerMetrics) -> FastAPI:
    """The OpenAI-compatible app, waiting for its engine (:func:`attach_engine`).

    Args:
        config: server settings (API key, stats interval, ...).
        metrics: the Prometheus metrics (the engine's step observer).
    """
    startup = Startup()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            startup.failed("the server is shutting down")
            if startup.state is not None:
                await startup.state.engine.shutdown()
                startup.state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="nybble", version=__version__, lifespan=lifespan)
    app.state.startup = startup
    app.state.server_config = config
    app.state.metrics = metrics
    install_error_handlers(app)
    # NOTE: the last added is the outermost: the request id on every answer, 500s for
    # anything, then the body limit
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(RequestIdMiddleware)
    install_openapi(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(routes_misc.v1_router)
    app.include_router(routes_misc.router)
    if config.allow_runtime_lora_updating:   # NOTE: vLLM serves these routes only when asked
        app.include_router(lora_routes.router)
    return app


def attach_engine(app: FastAPI, state: ServerState) -> None:
    """Start serving ``state.engine`` (its core is ready): requests held until now proceed."""
    state.engine.start()
    # NOTE: the start-up objects (web stack, schemas, tokenizer) never die: moved out of the
    # collector's sight, so its full collections, which hold the GIL, stay short under load
    gc.collect()
    gc.freeze()
    startup: Startup = app.state.startup
    startup.ready(state)
    logger.info("serving %s at %s/v1 (OpenAI API; also /health, /metrics)",
                state.model_name, state.config.url)
