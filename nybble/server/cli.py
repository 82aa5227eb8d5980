"""``nybble serve [MODEL]``: start the OpenAI-compatible server (flags named like vLLM's)."""
from __future__ import annotations

import argparse
from typing import Any

from nybble.engine_args import parse_bytes, add_engine_args
from nybble.server.config import (
    API_KEY_ENV,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    RUNTIME_LORA_ENV,
    ServerConfig,
    parse_lora_module,
)
from nybble.server.reasoning import REASONING_PARSERS
from nybble.server.tool_parsers import TOOL_PARSERS

_DEFAULTS = ServerConfig()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP server flags to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind; 0.0.0.0 listens on every interface")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                        help="model names the API accepts; the first is the one responses "
                             "report, /v1/models lists all (default: the model folder's "
                             "name, or a GGUF file's name without .gguf)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize, "
                             "/detokenize and /internal/stats; /health, /metrics and /version "
                             f"stay open (default: ${API_KEY_ENV} if set, else no key)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (info logs every request)")
    parser.add_argument("--stats-interval", type=float, default=5.0,
                        help="seconds between stats lines in the log while busy")
    chat = parser.add_argument_group(
        "chat: templates, tool calling and reasoning (vLLM's flags; docs/serving.md, 'Tool "
        "calling')")
    chat.add_argument("--chat-template", default=None, metavar="FILE|TEXT",
                      help="a jinja2 chat template (a file, or the template text) replacing "
                           "the model's (its folder's, or a GGUF file's metadata)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="serve tool_choice 'auto' (the default with tools): the model's "
                           "output is parsed for calls by --tool-call-parser")
    chat.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                      help="the tool-call format the model writes (hermes: Qwen and Hermes "
                           "<tool_call>; llama3_json; mistral: [TOOL_CALLS]; pythonic: "
                           "[f(a=1)])")
    chat.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                      help="split <think>...</think> reasoning into reasoning_content "
                           "(deepseek_r1: reasoning up to </think>; qwen3: only when the "
                           "output opens with <think>)")
    chat.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                      help="auto: the model folder's generation_config.json gives defaults "
                           "for sampling fields a request omits (temperature, top_p, top_k, "
                           "min_p, repetition_penalty, max_new_tokens); vllm: OpenAI's "
                           "defaults only; or another folder's generation_config.json "
                           "(default: auto)")
    limits = parser.add_argument_group(
        "request and connection limits",
        "what one client can make the server hold (see README, 'Limits')")
    limits.add_argument("--max-request-body-bytes", type=parse_bytes,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies are refused with 413 before they are "
                             "read (bytes, or e.g. 16MiB; default: 2MiB)")
    limits.add_argument("--max-num-waiting-requests", type=int,
                        default=_DEFAULTS.max_num_waiting_requests,
                        help="admission control: while this many requests wait for their "
                             "first engine step, new ones get 503 with Retry-After "
                             "(default: %(default)s)")
    limits.add_argument("--max-seqs-per-request", type=int,
                        default=_DEFAULTS.max_seqs_per_request,
                        help="most prompts x n in one request; more is a 400 "
                             "(default: %(default)s)")
    limits.add_argument("--timeout-keep-alive", type=float,
                        default=_DEFAULTS.timeout_keep_alive_s,
                        help="seconds an idle connection is kept open, between requests or "
                             "before its first (uvicorn's keep-alive timeout; default: "
                             "%(default)s)")
    limits.add_argument("--timeout-request-read", type=float,
                        default=_DEFAULTS.timeout_request_read_s,
                        help="seconds a request may take to arrive whole (headers and body) "
                             "from its first byte; then its connection is closed (default: "
                             "%(default)s)")
    limits.add_argument("--limit-concurrency", type=int, default=_DEFAULTS.limit_concurrency,
                        help="uvicorn answers new requests with a plain 503 while this many "
                             "connections are open or requests in flight (default: "
                             "%(default)s; the open-file limit is raised to fit)")
    limits.add_argument("--api-threads", type=int, default=_DEFAULTS.api_threads,
                        help="worker threads of the API process for tokenization, chat "
                             "templates and logprob rendering (default: %(default)s)")
    lora = parser.add_argument_group(
        "LoRA adapters", "Adapters on the base model, picked by a request's `model` (with "
                         "--enable-lora; docs/lora.md).")
    lora.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                      metavar="name=path|JSON",
                      help='PEFT adapter folders to serve: name=path, or '
                           '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           f"(also with {RUNTIME_LORA_ENV}=1, as in vLLM)")


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
    engine_config = engine_config_from_args(args, served_model_name=(
        server_config.served_model_names[0] if server_config.served_model_names else None))
    if server_config.lora_modules and not engine_config.lora_config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return run_server(engine_config, server_config)
