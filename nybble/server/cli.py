"""``nybble serve [MODEL]``: start the OpenAI-compatible server (flags named like vLLM's)."""
from __future__ import annotations

import argparse
from typing import Any

from nybble.engine_args import add_engine_args
from nybble.server.config import API_KEY_ENV


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP server flags to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind; 0.0.0.0 listens on every interface")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="model name the API reports and accepts (default: the model "
                             "folder's name)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1 routes "
                             f"(default: ${API_KEY_ENV} if set, else no key)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (info logs every request)")
    parser.add_argument("--stats-interval", type=float, default=5.0,
                        help="seconds between stats lines in the log while busy")


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand to the ``nybble`` parser."""
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
                    "/metrics). Without MODEL, serves the bundled stories260k model.")
    add_engine_args(parser, model_positional=True)
    add_server_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the configs from ``args`` and serve until interrupted; returns the exit code."""
    # NOTE: imported here so `nybble --help` does not pay for torch / fastapi imports
    from nybble.engine_args import engine_config_from_args
    from nybble.server.config import ServerConfig
    from nybble.server.launch import run_server

    server_config = ServerConfig.from_args(args)
    engine_config = engine_config_from_args(args, served_model_name=args.served_model_name)
    return run_server(engine_config, server_config)
