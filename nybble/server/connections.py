"""uvicorn's HTTP/1.1 protocol with an idle timeout from the moment a connection opens.

uvicorn arms its keep-alive timeout only after a response, so a client that opens a TCP
connection and never sends a request holds it (and a file descriptor, and a slot of
``--limit-concurrency``) forever. This protocol arms the same timer when the connection is
made; the first bytes of a request disarm it, as they do between requests.
"""
from __future__ import annotations

import asyncio


def idle_timeout_protocol() -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class, with the idle timer armed on connection (a function:
    uvicorn is imported only once the engine-core process has started)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleTimeoutH11Protocol(H11Protocol):
        """:class:`H11Protocol` that closes a connection idle since it opened."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    return IdleTimeoutH11Protocol
