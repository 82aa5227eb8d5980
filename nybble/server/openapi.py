"""The OpenAPI document (``/openapi.json``) says what the server does.

Schema-conformance fuzzing (``benchmarks/api_fuzz.py``) checks every answer against it, so it
must be exact: each route lists its real 200 model (and, for the generation routes, the SSE
stream), and the errors it can answer with, all OpenAI error bodies. FastAPI's default 422
validation answer is replaced by the 400 the server sends (``server/errors.py``).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from nybble.server.responses import ErrorResponse

_ERRORS = {
    400: "Invalid request: a schema or range error, a prompt too long (OpenAI error body "
         "naming `param`).",
    401: "Missing or wrong API key (when the server has one).",
    404: "`model` is not the served model.",
    413: "The request body is larger than --max-request-body-bytes.",
    500: "Internal error (a short message; details are in the server log).",
    503: "Not ready, shutting down, the engine is gone, or overloaded (admission control: "
         "a `Retry-After` header says when to retry).",
}

_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the given error statuses, each an OpenAI error body."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


_STREAM_MODELS: dict[str, type[BaseModel]] = {}
"""Models that only events of a stream carry (added to the document's components)."""


def _event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a generation stream: its ``data`` is ``[DONE]`` or the JSON
    of a ``chunk`` or an ``ErrorResponse`` (``contentMediaType``/``contentSchema``, which
    schema-conformance fuzzers check event by event)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in (chunk, ErrorResponse)]
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": refs}}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"const": "message"}}}


def generation_responses(response: type[BaseModel],
                         chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation route: the JSON ``response``, or with ``stream: true``
    server-sent events of ``chunk`` objects, and every error it can answer with."""
    stream = (f"With `stream: true`: server-sent events, `data: <{chunk.__name__} JSON>` per "
              f"event, ending with `data: [DONE]`; an error after the stream started is one "
              f"`data: <ErrorResponse JSON>` event before `[DONE]`.")
    _STREAM_MODELS[chunk.__name__] = chunk
    schema = {**_event_schema(chunk), "description": stream}
    ok = {"model": response, "description": "The whole answer, or the event stream.",
          "content": {"text/event-stream": {"schema": schema}}}
    return {200: ok, **error_responses(400, 401, 404, 413, 500, 503)}


def _add_stream_models(components: dict[str, Any]) -> None:
    """Put the stream-only models (and the models they use) into ``components``."""
    for name, model in _STREAM_MODELS.items():
        if name in components:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for sub, sub_schema in schema.pop("$defs", {}).items():
            components.setdefault(sub, sub_schema)
        components[name] = schema


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` document the 400 answers instead of FastAPI's 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _add_stream_models(components)
            for name in _FASTAPI_VALIDATION_SCHEMAS:
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
