"""The LoRA adapters the server serves, by name (vLLM's ``--lora-modules`` and
``/v1/load_lora_adapter``): a request picks one by its ``model`` field.

Each adapter gets a fresh ``lora_int_id`` when it is added, so an adapter unloaded and loaded
again under the same name (perhaps from another folder) never reuses the engine's cached
weights or prefix-cache blocks of the old one. A folder is checked here, against the base's
shapes and ``max_lora_rank`` from the engine's :class:`~nybble.runtime.messages.LoRALimits`,
before any request can use it (:func:`nybble.lora_files.read_adapter`, no torch).
"""
from __future__ import annotations

import itertools

from nybble.errors import InvalidRequestError, ModelNotFoundError
from nybble.lora_files import BaseTargets, read_adapter
from nybble.lora_request import LoRARequest
from nybble.runtime.messages import LoRALimits


class LoRARegistry:
    """Adapters by name.

    Args:
        limits: what the engine serves (from its handshake).
        base_name: the base model's reported name (an adapter's default ``parent``).
        reserved: names an adapter may not take (the base model's names).
    """

    def __init__(self, limits: LoRALimits, base_name: str, reserved: tuple[str, ...]) -> None:
        self.limits, self.base_name, self.reserved = limits, base_name, reserved
        self.targets = BaseTargets(limits.num_layers,
                                   {k: tuple(v) for k, v in limits.shapes.items()})
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def check(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """What :meth:`add` checks, the folder included (file I/O: call it off the event
        loop).

        Raises:
            as :meth:`add`, and LoRAAdapterError: the folder cannot be served on this base
            (400).
        """
        self._check_names(name, path, base_model_name)
        read_adapter(path, self.targets, self.limits.max_lora_rank)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the folder (checked by :meth:`check`) under ``name``.

        Raises:
            InvalidRequestError: an empty name, a name in use (the base model's or another
                adapter's), or a ``base_model_name`` that is not the base (400).
        """
        self._check_names(name, path, base_model_name)
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.base_name)
        self.adapters[name] = lora
        return lora

    def _check_names(self, name: str, path: str, base_model_name: str | None) -> None:
        if not name or not path:
            raise InvalidRequestError("lora_name and lora_path must be non-empty strings",
                                      param="lora_name" if not name else "lora_path")
        if name in self.reserved or name in self.adapters:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded "
                                      f"(a served model has that name); unload it first or "
                                      f"pick another name", param="lora_name")
        if base_model_name is not None and base_model_name not in self.reserved:
            raise InvalidRequestError(f"base_model_name must name the served base model "
                                      f"({', '.join(self.reserved)}), got "
                                      f"{base_model_name!r}", param="base_model_name")

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (requests already running finish under it).

        Raises:
            ModelNotFoundError: no adapter of that name (404).
        """
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found; loaded: "
                                     f"{', '.join(self.adapters) or 'none'}")
        return lora
