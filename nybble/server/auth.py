"""API-key check for the ``/v1`` routes (``--api-key`` or ``$NYBBLE_API_KEY``).

Like vLLM, only ``/v1/*`` is protected; ``/health``, ``/metrics``, ``/version``,
``/tokenize`` and ``/detokenize`` stay open for probes and scrapers.
"""
from __future__ import annotations

import hmac

from fastapi import Request

from nybble.server.config import ServerConfig
from nybble.server.errors import AuthenticationError


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: accept ``Authorization: Bearer <key>`` when a key is configured.

    Raises:
        AuthenticationError: the header is missing, malformed, or holds another key (401).
    """
    config: ServerConfig = request.app.state.server_config
    expected = config.api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    # NOTE: constant-time comparison, so response timing does not leak the key
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise AuthenticationError("incorrect API key provided")
