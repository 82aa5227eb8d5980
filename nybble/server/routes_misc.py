"""Small routes: ``/v1/models``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``,
``/metrics`` (Prometheus) and ``/internal/stats`` (the engine's counters, for tests and ops)."""
from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from nybble.errors import InvalidRequestError
from nybble.server.auth import require_api_key
from nybble.server.metrics import ServerMetrics
from nybble.server.protocol import DetokenizeRequest, TokenizeRequest
from nybble.server.responses import ModelCard, ModelList
from nybble.server.serving import render_chat
from nybble.server.state import Startup, get_state, wait_ready
from nybble.version import __version__

v1_router = APIRouter(dependencies=[Depends(require_api_key), Depends(wait_ready)])
router = APIRouter()
_READY = [Depends(wait_ready)]


@v1_router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The one served model."""
    state = get_state(request)
    return ModelList(data=[ModelCard(id=state.model_name, root=state.model_path,
                                     max_model_len=state.max_model_len)])


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine core process runs and can step, 503 otherwise (still starting,
    dead core, repeated step failures, shutting down)."""
    startup: Startup = request.app.state.startup
    ok = startup.state is not None and startup.state.engine.is_running
    return Response(status_code=200 if ok else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    """The nybble version."""
    return {"version": __version__}


@router.post("/tokenize", dependencies=_READY)
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    """Token ids of ``prompt`` (or of chat ``messages`` rendered with the chat template).

    Raises:
        InvalidRequestError: neither or both of ``prompt`` and ``messages`` (400).
    """
    state = get_state(request)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        ids = render_chat(state, req.messages, req.add_generation_prompt)
        state.input_processor.check_token_ids(ids, "messages")
    else:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": None}


@router.post("/detokenize", dependencies=_READY)
async def detokenize(req: DetokenizeRequest, request: Request) -> dict[str, str]:
    """The text of token ids.

    Raises:
        InvalidRequestError: an id outside the vocabulary (400).
    """
    state = get_state(request)
    state.check_model(req.model)
    state.input_processor.check_token_ids(req.tokens, "tokens", allow_empty=True)
    return {"prompt": state.tokenizer.decode(req.tokens)}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/internal/stats", dependencies=_READY)
async def internal_stats(request: Request) -> dict[str, Any]:
    """The engine core's counters as JSON, read between two of its steps."""
    return stats_dict(await get_state(request).engine.get_stats())


def stats_dict(stats: Any) -> dict[str, Any]:
    """A stats object (dataclass, named tuple or plain object) as a dict."""
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    if hasattr(stats, "_asdict"):
        return dict(stats._asdict())
    return {k: v for k, v in vars(stats).items() if not k.startswith("_")}
