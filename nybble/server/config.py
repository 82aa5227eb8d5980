"""ServerConfig: the HTTP server's settings, built once from ``nybble serve`` flags."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

API_KEY_ENV = "NYBBLE_API_KEY"
"""Environment variable read when ``--api-key`` is not given."""

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM's environment variable that enables ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (``1`` or ``true``), as ``--allow-runtime-lora-updating`` does."""

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

DEFAULT_MAX_REQUEST_BODY_BYTES = 2 << 20
"""2 MiB: a whole 128K-token prompt as JSON token ids is about 0.9 MB. Parsing a body holds
the event loop (``json.loads`` and pydantic hold the GIL): about 40 ms per MiB of token ids
on the dev machine, so the default keeps ``/health`` under 100 ms during the largest body."""


@dataclass(frozen=True)
class ServerConfig:
    """How the OpenAI-compatible server listens and answers.

    Attributes:
        host: interface to bind (``127.0.0.1`` by default; ``0.0.0.0`` for every interface).
        port: TCP port (default 8000); ``0`` <= port <= 65535.
        served_model_names: the model names the API accepts; the first is the one responses
            report (vLLM's ``--served-model-name a b``); empty: the engine's ``model_name``.
        api_key: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
        uvicorn_log_level: uvicorn's log level (``info`` logs each request).
        stats_interval_s: seconds between stats lines in the log while busy.
        log_stats: log the periodic stats line.
        max_request_body_bytes: larger request bodies get a 413 before they are read.
        max_num_waiting_requests: admission control: while this many requests wait for
            their first engine step, new ones get a 503 with ``Retry-After``.
        max_seqs_per_request: prompts x ``n`` of one request at most (400 beyond).
        timeout_keep_alive_s: an idle connection (between requests, or before its first)
            is closed after this many seconds.
        timeout_request_read_s: a request whose headers and body have not all arrived this
            many seconds after its first byte has its connection closed (slowloris).
        limit_concurrency: uvicorn answers 503 (plain text) to new requests while this many
            connections are open or requests are in flight.
        api_threads: worker threads for tokenization, chat templates and logprob rendering.
        enable_auto_tool_choice: ``tool_choice: "auto"`` is served (needs
            ``tool_call_parser``).
        tool_call_parser: how model output is read for tool calls (a name of
            :data:`nybble.server.tool_parsers.TOOL_PARSERS`), or ``None``.
        reasoning_parser: how ``<think>`` reasoning is split from the answer (a name of
            :data:`nybble.server.reasoning.REASONING_PARSERS`), or ``None``.
        chat_template: a jinja2 chat template replacing the model's (the text), or ``None``.
        generation_config: ``auto``: the model folder's ``generation_config.json`` gives the
            defaults of sampling fields a request leaves out (vLLM's default); ``vllm``:
            OpenAI's defaults only; or a folder holding a ``generation_config.json``.
        lora_modules: LoRA adapters served from the start, ``(name, path, base_model_name)``
            (``--lora-modules``; needs ``--enable-lora``).
        allow_runtime_lora_updating: serve ``/v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` (``--allow-runtime-lora-updating`` or
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).

    Raises:
        ValueError: a value outside its range.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    uvicorn_log_level: str = "info"
    stats_interval_s: float = 5.0
    log_stats: bool = True
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_num_waiting_requests: int = 1024
    max_seqs_per_request: int = 1024
    timeout_keep_alive_s: float = 5.0
    timeout_request_read_s: float = 30.0
    limit_concurrency: int = 4096
    api_threads: int = 4
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        from nybble.server.reasoning import REASONING_PARSERS
        from nybble.server.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (one of "
                             f"{sorted(TOOL_PARSERS)})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.uvicorn_log_level not in _LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {_LOG_LEVELS}, "
                             f"got {self.uvicorn_log_level!r}")
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be > 0, got {self.stats_interval_s!r}")
        for name in ("max_request_body_bytes", "max_num_waiting_requests",
                     "max_seqs_per_request", "limit_concurrency", "api_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("timeout_keep_alive_s", "timeout_request_read_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """Build from ``nybble serve`` flags; the API key falls back to ``$NYBBLE_API_KEY``."""
        return cls(host=args.host, port=args.port,
                   served_model_names=tuple(args.served_model_name or ()),
                   api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                   uvicorn_log_level=args.uvicorn_log_level,
                   stats_interval_s=args.stats_interval,
                   log_stats=not args.disable_log_stats,
                   max_request_body_bytes=args.max_request_body_bytes,
                   max_num_waiting_requests=args.max_num_waiting_requests,
                   max_seqs_per_request=args.max_seqs_per_request,
                   timeout_keep_alive_s=args.timeout_keep_alive,
                   timeout_request_read_s=args.timeout_request_read,
                   limit_concurrency=args.limit_concurrency, api_threads=args.api_threads,
                   enable_auto_tool_choice=args.enable_auto_tool_choice,
                   tool_call_parser=args.tool_call_parser,
                   reasoning_parser=args.reasoning_parser,
                   chat_template=load_chat_template(args.chat_template),
                   generation_config=args.generation_config,
                   lora_modules=tuple(args.lora_modules or ()),
                   allow_runtime_lora_updating=args.allow_runtime_lora_updating or
                   os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"))


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """One ``--lora-modules`` value (vLLM's forms): ``name=path`` or the JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` -> ``(name, path,
    base_model_name)``.

    Raises:
        argparse.ArgumentTypeError: neither form.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules JSON is not valid: {e}") from None
        name, path = value.get("name"), value.get("path")
        base = value.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path or \
                not (base is None or isinstance(base, str)) or \
                set(value) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(
                f'--lora-modules JSON must be {{"name": str, "path": str, "base_model_name": '
                f'str (optional)}}, got {text!r}')
        return name, path, base
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules must be name=path or a JSON object "
                                         f'{{"name": ..., "path": ...}}, got {text!r}')
    return name, path, None


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template FILE|TEXT`` (vLLM's flag): a file's text, or the value itself when
    it is a template (holds ``{{`` or ``{%``).

    Raises:
        ValueError: neither a readable file nor template text.
    """
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template must be a template file or jinja2 template text, got "
                     f"{value!r} (no such file, and no '{{{{' or '{{%' in it)")
