"""Map exceptions to OpenAI-style error responses: ``{"error": {message, type, param, code}}``.

===============================================  ======  ==========================
exception                                        status  type / code
===============================================  ======  ==========================
InvalidRequestError (incl. KVCacheExhausted)     400     invalid_request_error
RequestValidationError (bad JSON, bad types)     400     invalid_request_error
ModelNotFoundError                               404     invalid_request_error / model_not_found
AuthenticationError                              401     invalid_request_error / invalid_api_key
EngineDeadError (engine core gone)               503     service_unavailable
EngineShutdownError (server shutting down)       503     service_unavailable
EngineOverloadedError (admission control)        503     service_unavailable + Retry-After
RequestTooLargeError (body over the limit)       413     invalid_request_error
EngineRequestError (the engine failed a step)    500     internal_error
HTTPException (404 route, 405 method, ...)       status  invalid_request_error
anything else                                    500     internal_error (``middleware.py``)
===============================================  ======  ==========================

A 500 body never carries internal exception text: a short message, with the details in the
server log.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nybble.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    EngineShutdownError,
    InvalidRequestError,
    ModelNotFoundError,
    NybbleError,
)
from nybble.server.protocol import PROMPT_FORMS
from nybble.server.responses import ErrorInfo, ErrorResponse

_UNION_LABEL = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*(\[.*\])?)$")
"""The labels pydantic puts in an error location for the member of a union it tried
(``str``, ``list[ContentPart]``, a model's class name): types, not fields."""


def _field_location(loc: list[str]) -> tuple[list[str], str | None]:
    """An error location without the union members pydantic tried, and the prompt form it was
    read as (``prompt.ids.1`` -> ``prompt.1``, "a list of token ids")."""
    form = None
    if len(loc) > 1 and loc[0] == "prompt" and loc[1] in PROMPT_FORMS:
        form, loc = PROMPT_FORMS[loc[1]], [loc[0], *loc[2:]]
    return [x for x in loc if not _UNION_LABEL.match(x)], form


logger = logging.getLogger(__name__)


class AuthenticationError(NybbleError):
    """The API key is missing or wrong (HTTP 401)."""


class RequestTooLargeError(NybbleError):
    """The request body is larger than the server accepts (HTTP 413)."""


def error_response(status: int, message: str, err_type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying an OpenAI error body with HTTP ``status``."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=code if code is not None else status))
    return JSONResponse(status_code=status, content=body.body(), headers=headers)


def error_payload(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` for ``exc``, for errors raised inside a stream (sent as an SSE event)."""
    resp = response_for(exc)
    return resp.status_code, json.loads(bytes(resp.body))


def response_for(exc: BaseException) -> JSONResponse:
    """The OpenAI error response for ``exc`` (unexpected ones: a 500 with a short message and
    an error id; the traceback is logged with that id)."""
    if isinstance(exc, AuthenticationError):
        return error_response(401, str(exc), code="invalid_api_key")
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return error_response(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return error_response(503, str(exc), err_type="service_unavailable",
                              headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, (EngineDeadError, EngineShutdownError)):
        return error_response(503, str(exc), err_type="service_unavailable")
    if isinstance(exc, RequestTooLargeError):
        return error_response(413, str(exc))
    if isinstance(exc, EngineRequestError):  # NOTE: the core logged the traceback
        logger.warning("request failed in the engine: %s", exc)
        return error_response(500, "the engine failed this request (internal error; see the "
                                   "server log)", err_type="internal_error")
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s", error_id, exc_info=exc)
    return error_response(500, f"internal server error (error id {error_id}; see the server "
                               f"log)", err_type="internal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the first offending parameter."""
    parts: dict[str, list[str]] = {}   # location -> messages (a union's members, merged)
    param = None
    for err in exc.errors():
        loc, form = _field_location([str(x) for x in err.get("loc", ()) if x != "body"])
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('msg', '')}", None
        cause = err.get("ctx", {}).get("error") if err.get("type") == "value_error" else None
        param = param or (loc[0] if loc else getattr(cause, "param", None))
        if cause is not None:
            parts.setdefault(str(cause), [])  # NOTE: our validators name the field
            continue
        msg = err.get("msg", "invalid value") + (f" (read as {form})" if form else "")
        seen = parts.setdefault(".".join(loc) or "body", [])
        if msg not in seen:
            seen.append(msg)
    lines = [where if not msgs else f"{where}: " + " or ".join(
        [msgs[0], *(m.removeprefix("Input should be ") for m in msgs[1:])])
        for where, msgs in parts.items()]
    return "invalid request: " + "; ".join(lines), param


def _is_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of ``content_type`` as JSON (``application/json`` or a
    ``+json`` subtype)."""
    mime = content_type.split(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/")
                                          and mime.endswith("+json"))


def install_error_handlers(app: FastAPI) -> None:
    """Register the exception -> OpenAI error body handlers on ``app``."""

    async def on_nybble(_: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        ctype = request.headers.get("content-type")
        if (ctype is None or not _is_json(ctype)) and \
                any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
            # NOTE: FastAPI parses JSON only under a JSON content type (curl -d sends a form)
            got = "no Content-Type" if ctype is None else f"Content-Type {ctype!r}"
            message = ("the request body must be a JSON object sent with Content-Type: "
                       f"application/json, got {got}")
        return error_response(400, message, param=param)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc.__cause__, NybbleError):  # NOTE: FastAPI wraps body-read errors
            return response_for(exc.__cause__)
        return error_response(exc.status_code, str(exc.detail))

    app.add_exception_handler(NybbleError, on_nybble)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
