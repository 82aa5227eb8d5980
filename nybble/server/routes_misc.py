"""Small routes: ``/v1/models`` (and ``/v1/models/{id}``), ``/health`` (GET and HEAD),
``/version``, ``/tokenize``, ``/detokenize``, ``/metrics`` (Prometheus) and ``/internal/stats``
(the engine's counters, for tests and ops)."""
from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from nybble.errors import InvalidRequestError
from nybble.runtime.messages import EngineStats
from nybble.server.auth import require_api_key
from nybble.server.metrics import ServerMetrics
from nybble.server.openapi import error_responses
from nybble.server.protocol import DetokenizeRequest, TokenizeRequest
from nybble.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from nybble.server.serving import json_response, render_chat
from nybble.server.state import ServerState, Startup, get_state, run_blocking, wait_ready
from nybble.version import __version__

_GUARDED = [Depends(require_api_key), Depends(wait_ready)]
v1_router = APIRouter(dependencies=_GUARDED, responses=error_responses(401, 500, 503))
router = APIRouter()
_BODY_ERRORS = error_responses(400, 401, 404, 413, 500, 503)


@v1_router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The served model, one card per served name (``root`` is the model folder's name,
    never its path), then one card per LoRA adapter (``root``: its folder's name, ``parent``:
    the base model's id)."""
    state = get_state(request)
    adapters = [] if state.lora is None else list(state.lora.adapters)
    return ModelList(data=[_card(state, name) for name in (*state.model_names, *adapters)])


@v1_router.get("/v1/models/{model:path}", responses=error_responses(404))
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """One model by its id (OpenAI's ``models.retrieve``): the served model's or a LoRA
    adapter's card, or a 404 (``model_not_found``) for any other id."""
    state = get_state(request)
    state.check_model(model)
    return _card(state, model)


def _card(state: ServerState, name: str) -> ModelCard:
    lora = state.lora_request(name)
    if lora is not None:
        return ModelCard(id=name, root=os.path.basename(os.path.normpath(lora.lora_path)),
                         parent=lora.base_model_name, max_model_len=state.max_model_len)
    return ModelCard(id=name, root=state.model_path,
                     max_model_len=state.max_model_len)


@router.api_route("/health", methods=["GET", "HEAD"], response_class=Response,
                  responses={200: {"description": "The engine can serve."},
                             503: {"description": "Starting, shutting down, or the engine is "
                                                  "gone (restart it)."}})
async def health(request: Request) -> Response:
    """200 while the engine core process runs and can step, 503 otherwise (still starting,
    dead core, repeated step failures, shutting down)."""
    startup: Startup = request.app.state.startup
    ok = startup.state is not None and startup.state.engine.is_running
    return Response(status_code=200 if ok else 503)


@router.get("/version")
async def version() -> VersionResponse:
    """The nybble version."""
    return VersionResponse(version=__version__)


def _tokenize(state: ServerState, req: TokenizeRequest) -> Response:
    if req.messages is not None:
        ids = render_chat(state, req, req.messages)
        state.input_processor.check_token_ids(ids, "messages")
    else:
        assert req.prompt is not None
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return json_response(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len,
                                          tokens=ids))


@router.post("/tokenize", dependencies=_GUARDED, response_model=None,
             responses={200: {"model": TokenizeResponse}, **_BODY_ERRORS})
async def tokenize(req: TokenizeRequest, request: Request) -> Response:
    """Token ids of ``prompt`` (or of chat ``messages`` rendered with the chat template).

    Raises:
        InvalidRequestError: neither or both of ``prompt`` and ``messages``, or a content part
            that is not text (400).
    """
    state = get_state(request)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    return await run_blocking(state, _tokenize, state, req)


@router.post("/detokenize", dependencies=_GUARDED, responses=_BODY_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids.

    Raises:
        InvalidRequestError: an id outside the vocabulary (400).
    """
    state = get_state(request)
    state.check_model(req.model)
    state.input_processor.check_token_ids(req.tokens, "tokens", allow_empty=True)
    text = await run_blocking(state, state.tokenizer.decode, req.tokens)
    return DetokenizeResponse(prompt=text)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]:
                                         {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition."}})
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/internal/stats", dependencies=_GUARDED, responses=error_responses(401, 500, 503))
async def internal_stats(request: Request) -> EngineStats:
    """The engine core's counters, read between two of its steps."""
    return await get_state(request).engine.get_stats()

