"""An SSE answer whose client is gone aborts its unfinished engine requests however the
answer ends: the response does it, not only its body generator's ``finally`` (which never
runs if the generator is cancelled before it first runs)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from nybble.runtime.frontend.async_engine import RequestStream
from nybble.server.serving import EngineStreamingResponse


def test_stream_whose_client_is_gone_is_aborted() -> None:
    aborted: list[str] = []
    state: Any = SimpleNamespace(engine=SimpleNamespace(abort=aborted.append))
    streams = [RequestStream("r-0"), RequestStream("r-1")]
    streams[1].finished = True                      # already ended: not aborted again

    async def body() -> AsyncIterator[str]:        # waits for a first token, no finally
        await asyncio.Event().wait()
        yield "data: [DONE]\n\n"

    async def receive() -> dict[str, str]:
        return {"type": "http.disconnect"}         # gone already, as uvicorn then answers

    async def send(_: dict[str, Any]) -> None:
        return None

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST",
             "headers": []}
    asyncio.run(asyncio.wait_for(
        EngineStreamingResponse(state, streams, body())(scope, receive, send), 10))
    assert aborted == ["r-0"]
