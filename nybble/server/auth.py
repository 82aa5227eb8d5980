"""API-key check (``--api-key`` or ``$NYBBLE_API_KEY``).

The key protects every route that serves the model or reveals its state: ``/v1/*``,
``/tokenize``, ``/detokenize`` (they run the tokenizer on the caller's input) and
``/internal/stats``. ``/health``, ``/metrics`` and ``/version`` stay open for probes and
scrapers. The OpenAPI document declares the bearer scheme on the protected routes.
"""
from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nybble.server.config import ServerConfig
from nybble.server.errors import AuthenticationError

_BEARER = HTTPBearer(auto_error=False, description="the server's --api-key, when it has one")


async def require_api_key(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]) -> None:
    """FastAPI dependency: accept ``Authorization: Bearer <key>`` when a key is configured.

    Raises:
        AuthenticationError: the header is missing, malformed, or holds another key (401).
    """
    config: ServerConfig = request.app.state.server_config
    expected = config.api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _sep, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    # NOTE: constant-time comparison, so response timing does not leak the key
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise AuthenticationError("incorrect API key provided")
