"""uvicorn's HTTP/1.1 protocol with two more timeouts: idle from the moment a connection opens,
and a bound on how long a request may take to arrive.

uvicorn arms its keep-alive timeout only after a response, so a client that opens a TCP
connection and never sends a request holds it (and a file descriptor, and a slot of
``--limit-concurrency``) forever. This protocol arms the same timer when the connection is
made; the first bytes of a request disarm it, as they do between requests.

Those first bytes disarm it for good in uvicorn: a client that sends part of a request (one
byte, headers without the blank line, a body shorter than its ``Content-Length``) and then
nothing holds the connection as long as it likes, so a few thousand such sockets lock every
other client out (the slowloris attack). Here the first bytes of a request also arm a
request-read timer: when the whole request (headers and body) has not arrived within
``--timeout-request-read`` seconds of its first byte, the connection is closed (the app, if it
was reading the body, sees a disconnect), as nginx's ``client_header_timeout`` and
``client_body_timeout`` do. The timer runs from the first byte and is not extended by later
ones, so dripping a byte at a time does not keep a connection either.
"""
from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


def idle_timeout_protocol(timeout_request_read_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class, with the idle timer armed on connection and a
    request-read timeout of ``timeout_request_read_s`` seconds (a function: uvicorn is
    imported only once the engine-core process has started)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    receiving = (h11.IDLE, h11.SEND_BODY)   # the client's states while a request is partial

    class IdleTimeoutH11Protocol(H11Protocol):
        """:class:`H11Protocol` that closes a connection idle since it opened, or one whose
        request does not arrive whole in time."""

        read_timeout_task: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in receiving and not self.transport.is_closing():
                if self.read_timeout_task is None:   # the request's first bytes
                    self.read_timeout_task = self.loop.call_later(
                        timeout_request_read_s, self._request_read_timed_out)
            else:
                self._cancel_read_timeout()

        def on_response_complete(self) -> None:
            self._cancel_read_timeout()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_timeout()
            super().connection_lost(exc)

        def _cancel_read_timeout(self) -> None:
            if self.read_timeout_task is not None:
                self.read_timeout_task.cancel()
                self.read_timeout_task = None

        def _request_read_timed_out(self) -> None:
            self.read_timeout_task = None
            if self.conn.their_state in receiving and not self.transport.is_closing():
                logger.info("closing a connection whose request did not arrive whole within "
                            "%.3g s (--timeout-request-read)", timeout_request_read_s)
                self.transport.close()

    return IdleTimeoutH11Protocol
