"""ASGI middleware: the request body limit, 500 answers that keep the connection, and the
``X-Request-Id`` echo.

- :class:`BodyLimitMiddleware` refuses a body larger than ``--max-request-body-bytes`` with
  a 413 OpenAI error body: at once when ``Content-Length`` says so (nothing is read), else
  as soon as the bytes received pass the limit (chunked uploads), before anything parses it.
- :class:`InternalErrorMiddleware` answers an unexpected exception with a 500 OpenAI error
  body carrying a short message (the traceback goes to the log with an error id), and does
  not re-raise it. Starlette's own last-resort handler re-raises after answering, and uvicorn
  then closes the connection, so a keep-alive client would lose it with every 500.
- :class:`RequestIdMiddleware` echoes a request's ``X-Request-Id`` header on its answer
  (errors too); the generation routes also make it the request's id (:func:`request_id`).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 128
"""A longer ``X-Request-Id`` (or one with characters outside printable ASCII) is ignored."""


def client_request_id(headers: list[tuple[bytes, bytes]] | dict[str, str]) -> str | None:
    """The client's ``X-Request-Id`` when it is usable as an id: 1 to
    :data:`MAX_REQUEST_ID_CHARS` printable ASCII characters without spaces; else ``None``.

    Args:
        headers: ASGI raw headers (lower-case byte names) or a mapping (Starlette's
            case-insensitive ``request.headers``).
    """
    if isinstance(headers, list):
        raw = dict(headers).get(REQUEST_ID_HEADER)
        value = raw.decode("latin-1") if raw is not None else None
    else:
        value = headers.get("x-request-id")
    if value is None or not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        return None
    return value if all(33 <= ord(c) < 127 for c in value) else None

from nybble.server.errors import RequestTooLargeError, error_response, response_for


def _too_large(limit: int, got: str) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body must be at most {limit} bytes "
                                f"(--max-request-body-bytes), got {got}")


class BodyLimitMiddleware:
    """Refuse HTTP request bodies larger than ``limit`` bytes (413).

    Args:
        app: the wrapped ASGI app.
        limit: the largest body accepted (bytes).
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            exc = _too_large(self.limit, f"Content-Length {int(declared)}")
            await error_response(413, str(exc))(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _too_large(self.limit, f"more than {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


class InternalErrorMiddleware:
    """Answer an unexpected exception with a 500 OpenAI error body, keeping the connection.

    If the answer had already started (a stream), the exception propagates (the connection
    cannot carry another answer).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            await response_for(exc)(scope, receive, send)


class RequestIdMiddleware:
    """Echo a usable ``X-Request-Id`` request header (:func:`client_request_id`) on the
    answer, as vLLM does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = client_request_id(scope["headers"]) if scope["type"] == "http" else None
        if rid is None:
            await self.app(scope, receive, send)
            return

        async def tag(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, tag)
