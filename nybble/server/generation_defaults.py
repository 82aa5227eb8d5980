"""``--generation-config``: sampling defaults from a model folder's ``generation_config.json``.

vLLM's rule (``--generation-config auto``, its default): the fields of the model's generation
config that sampling knows become the defaults of request fields left out; a request's own
value always wins. ``vllm`` turns it off (OpenAI's defaults: temperature 1, top_p 1, ...).
"""
from __future__ import annotations

import json
import os
from typing import Any

FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
          "max_new_tokens": "max_tokens"}
"""``generation_config.json`` key -> the sampling field it gives a default to."""


def generation_defaults(mode: str, model_folder: str) -> dict[str, Any]:
    """The request defaults of ``--generation-config mode`` for the model in
    ``model_folder`` (``{}`` for ``vllm``, a folder without the file, or ``auto`` with a
    model file such as a GGUF).

    Returns:
        ``{"temperature": 0.6, "max_tokens": 256, ...}``: only the keys the file sets.

    Raises:
        ValueError: ``mode`` is not ``auto``, ``vllm`` or a folder; the file is not a JSON
            object.
    """
    if mode == "vllm":
        return {}
    if mode == "auto" and not os.path.isdir(model_folder):
        return {}  # a model file (GGUF) has no generation_config.json beside its weights
    folder = model_folder if mode == "auto" else mode
    if not os.path.isdir(folder):
        raise ValueError(f"--generation-config must be auto, vllm or a folder holding a "
                         f"generation_config.json, got {mode!r}")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return {field: config[key] for key, field in FIELDS.items()
            if isinstance(config.get(key), (int, float)) and not isinstance(config[key], bool)}
