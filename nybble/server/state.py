"""ServerState: what every route handler needs, stored once on ``app.state.nybble``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from nybble.errors import ModelNotFoundError

if TYPE_CHECKING:
    from nybble.runtime.async_engine import AsyncEngine
    from nybble.runtime.input_processor import InputProcessor
    from nybble.runtime.tokenizer import Tokenizer
    from nybble.server.config import ServerConfig
    from nybble.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerState:
    """The server's shared objects.

    Attributes:
        engine: the API process's side of the engine (talks to the engine-core process).
        input_processor: the engine's request gate (stateless: called on the event loop).
        config: the server settings.
        model_name: the name the API reports and accepts.
        model_path: the model folder (``/v1/models`` ``root``).
        tokenizer: the model's tokenizer (prompts, chat templates, logprob tokens).
        max_model_len: longest sequence, prompt + output (tokens).
        metrics: the Prometheus metrics.
    """

    engine: AsyncEngine
    input_processor: InputProcessor
    config: ServerConfig
    model_name: str
    model_path: str
    tokenizer: Tokenizer
    max_model_len: int
    metrics: ServerMetrics

    def check_model(self, model: str | None) -> None:
        """Accept ``model`` if it is ``None`` or the served name.

        Raises:
            ModelNotFoundError: another name (HTTP 404).
        """
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`")


def get_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request``."""
    state: ServerState = request.app.state.nybble
    return state
