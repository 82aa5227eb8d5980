"""ServerState: what every route handler needs; Startup: whether the engine is ready yet.

HTTP starts while the engine core still loads (``nybble.server.launch``), so the app holds a
:class:`Startup` from the beginning and gets its :class:`ServerState` once the core's
handshake arrived. Routes that need the engine depend on :func:`wait_ready` (a request that
arrives early waits for the engine instead of failing); ``/health`` answers 503 until then.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from nybble.errors import EngineDeadError, ModelNotFoundError

if TYPE_CHECKING:
    from nybble.lora_request import LoRARequest
    from nybble.runtime.frontend.async_engine import AsyncEngine
    from nybble.server.lora_registry import LoRARegistry
    from nybble.runtime.frontend.input_processor import InputProcessor
    from nybble.tokenizer.tokenizer import Tokenizer
    from nybble.server.config import ServerConfig
    from nybble.server.metrics import ServerMetrics


PROMPT_CHAR_SLACK = 4
"""How much a tokenizer's normalizer is assumed to shrink text at most (NFC joins combining
marks), in the cheap prompt-length check (:attr:`ServerState.max_prompt_chars`)."""

T = TypeVar("T")


@dataclass(frozen=True)
class ServerState:
    """The server's shared objects, once the engine is ready.

    Attributes:
        engine: the API process's side of the engine (talks to the engine-core process).
        input_processor: the engine's request gate (stateless: called on the event loop).
        config: the server settings.
        model_name: the name the API reports and accepts.
        model_aliases: further names the API accepts for the same model.
        model_path: the model folder (``/v1/models`` ``root``).
        tokenizer: the model's tokenizer (prompts, chat templates, logprob tokens).
        max_model_len: longest sequence, prompt + output (tokens).
        metrics: the Prometheus metrics.
        executor: the worker threads for blocking work (tokenization, chat templates,
            logprob rendering), so the event loop stays free.
        max_token_chars: the longest token of the vocabulary (characters).
        sampling_defaults: defaults of sampling fields a request leaves out, from the
            model's ``generation_config.json`` (``--generation-config``; e.g.
            ``{"temperature": 0.6}``).
        lora: the LoRA adapters served (``--enable-lora``), or ``None``.
    """

    engine: AsyncEngine
    input_processor: InputProcessor
    config: ServerConfig
    model_name: str
    model_path: str
    tokenizer: Tokenizer
    max_model_len: int
    metrics: ServerMetrics
    executor: ThreadPoolExecutor
    max_token_chars: int
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    model_aliases: tuple[str, ...] = ()
    lora: LoRARegistry | None = None

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text prompt cannot fit ``max_model_len`` however it
        tokenizes: ``max_model_len * max_token_chars * PROMPT_CHAR_SLACK``."""
        return self.max_model_len * self.max_token_chars * PROMPT_CHAR_SLACK

    def check_model(self, model: str | None) -> None:
        """Accept ``model`` if it is ``None`` or a served name.

        Raises:
            ModelNotFoundError: another name (HTTP 404).
        """
        if model is not None and model not in self.model_names and \
                (self.lora is None or model not in self.lora.adapters):
            served = ", ".join(f"`{n}`" for n in self.model_names)
            if self.lora is not None and self.lora.adapters:
                served += "; LoRA adapters " + ", ".join(f"`{n}`" for n in self.lora.adapters)
            raise ModelNotFoundError(
                f"The model `{model}` does not exist; this server serves {served}")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, ``None`` for the base model."""
        if self.lora is None or model is None:
            return None
        return self.lora.adapters.get(model)

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter's name for an adapter, else the
        base's reported name."""
        return model if self.lora_request(model) is not None and model is not None \
            else self.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the API accepts, the reported one first."""
        return (self.model_name, *self.model_aliases)


class Startup:
    """The engine's readiness: :meth:`ready` with the state, or :meth:`failed` with why."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.state: ServerState | None = None
        self.error: str | None = None

    def ready(self, state: ServerState) -> None:
        """The engine is ready: release the waiting requests."""
        self.state = state
        self._event.set()

    def failed(self, why: str) -> None:
        """The engine will not be ready (start-up failed, or the server is stopping)."""
        self.error = why
        self._event.set()

    async def wait(self) -> ServerState:
        """The state, once ready.

        Raises:
            EngineDeadError: the engine failed to start (503).
        """
        await self._event.wait()
        if self.state is None:
            raise EngineDeadError(self.error or "the engine is not running")
        return self.state


async def wait_ready(request: Request) -> None:
    """FastAPI dependency: hold the request until the engine is ready.

    Raises:
        EngineDeadError: the engine failed to start (503).
    """
    startup: Startup = request.app.state.startup
    await startup.wait()


async def run_blocking(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the server's worker threads; its result (or exception) here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.executor, functools.partial(fn, *args))


def get_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request`` (routes that use it depend on
    :func:`wait_ready`)."""
    state = request.app.state.startup.state
    assert state is not None, "a route that needs the engine must depend on wait_ready"
    return state
