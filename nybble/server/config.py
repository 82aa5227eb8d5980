"""ServerConfig: the HTTP server's settings, built once from ``nybble serve`` flags."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

API_KEY_ENV = "NYBBLE_API_KEY"
"""Environment variable read when ``--api-key`` is not given."""

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    """How the OpenAI-compatible server listens and answers.

    Attributes:
        host: interface to bind (``127.0.0.1`` by default; ``0.0.0.0`` for every interface).
        port: TCP port (default 8000); ``0`` <= port <= 65535.
        served_model_name: the model name the API reports and accepts; default: the engine's
            ``model_name``.
        api_key: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
        uvicorn_log_level: uvicorn's log level (``info`` logs each request).
        stats_interval_s: seconds between stats lines in the log while busy.
        log_stats: log the periodic stats line.

    Raises:
        ValueError: a value outside its range.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    uvicorn_log_level: str = "info"
    stats_interval_s: float = 5.0
    log_stats: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.uvicorn_log_level not in _LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {_LOG_LEVELS}, "
                             f"got {self.uvicorn_log_level!r}")
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be > 0, got {self.stats_interval_s!r}")

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """Build from ``nybble serve`` flags; the API key falls back to ``$NYBBLE_API_KEY``."""
        return cls(host=args.host, port=args.port, served_model_name=args.served_model_name,
                   api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                   uvicorn_log_level=args.uvicorn_log_level,
                   stats_interval_s=args.stats_interval,
                   log_stats=not args.disable_log_stats)
