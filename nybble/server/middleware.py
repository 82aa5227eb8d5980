"""ASGI middleware: the request body limit, and 500 answers that keep the connection.

- :class:`BodyLimitMiddleware` refuses a body larger than ``--max-request-body-bytes`` with
  a 413 OpenAI error body: at once when ``Content-Length`` says so (nothing is read), else
  as soon as the bytes received pass the limit (chunked uploads), before anything parses it.
- :class:`InternalErrorMiddleware` answers an unexpected exception with a 500 OpenAI error
  body carrying a short message (the traceback goes to the log with an error id), and does
  not re-raise it. Starlette's own last-resort handler re-raises after answering, and uvicorn
  then closes the connection, so a keep-alive client would lose it with every 500.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
