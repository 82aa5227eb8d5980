"""The files of a model folder: which one is the config, the weights, the tokenizer, and the
one JSON reader every part of nybble uses for them.

A model is a local Hugging Face folder (``config.json``, ``*.safetensors``, tokenizer files)
or a GGUF file (``.gguf``), whose config and tokenizer files are written from its metadata
into a side folder (:mod:`nybble.gguf.side_folder`). Every function here is cheap: it lists a
folder and reads small JSON files, never a weight, and imports nothing heavy, so the CLI can
answer a bad path at once.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from nybble.errors import UnsupportedModelError

TOKENIZER_FILE = "tokenizer.json"
"""The ``tokenizers`` pipeline file of a Hugging Face model folder."""

TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer.model", "tokenizer_config.json")
"""The files that define a tokenizer: two models share one tokenizer when these are equal."""

WEIGHTS_INDEX = "model.safetensors.index.json"
"""The index of a sharded checkpoint (``weight_map``: tensor name -> shard file)."""
_SHARD = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")
_AUTOGPTQ = re.compile(r"gptq_model-\d+bit--?\d+g\.safetensors")  # group size -1 too


def read_json(path: str, *, lenient: bool = False) -> dict[str, Any] | None:
    """The JSON object in the file at ``path``.

    Args:
        path: the file.
        lenient: also answer ``None`` for a file that cannot be read or is not JSON
            (otherwise that raises).

    Returns:
        The object, or ``None`` when there is no such file or it holds another JSON value
        (a list, a number).

    Raises:
        OSError: the file cannot be read (unless ``lenient``).
        ValueError: the file is not JSON or not UTF-8 (unless ``lenient``).
    """
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        if lenient:
            return None
        raise
    return value if isinstance(value, dict) else None


def file_bytes(path: str) -> bytes | None:
    """The bytes of the file at ``path``, or ``None`` when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def has_tokenizer_file(folder: str) -> bool:
    """Whether ``folder`` holds a ``tokenizer.json`` (else the tokenizer needs transformers'
    conversion, see ``nybble.tokenizer.hf_tokenizer``)."""
    return os.path.isfile(os.path.join(folder, TOKENIZER_FILE))


def is_gguf(model: str) -> bool:
    """Whether the model path names a GGUF file (``.gguf``) rather than a folder."""
    return model.lower().endswith(".gguf")


def config_folder(model: str) -> str:
    """The folder holding ``config.json`` for ``model``: the model folder itself, or the
    side folder of a GGUF file (:func:`nybble.gguf.side_folder.side_folder_path`)."""
    if not is_gguf(model):
        return model
    from nybble.gguf.side_folder import side_folder_path

    return side_folder_path(model)


def check_model_dir(model_dir: str) -> None:
    """Fail early, with a clear message, unless ``model_dir`` is a local model folder.

    Cheap (no heavy import), so the CLI answers a bad path at once. A ``.gguf`` file is
    checked instead (magic, version, every shard present) and its side folder of
    Hugging Face files is written from its metadata if needed (:mod:`nybble.gguf.side_folder`).

    Raises:
        UnsupportedModelError: no such folder, a file instead of a folder, or no
            ``config.json`` in it; for a GGUF file, any of the checks above.
    """
    if is_gguf(model_dir):
        from nybble.gguf.side_folder import ensure_side_folder

        ensure_side_folder(model_dir)
        return
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return
    what = ("has no config.json" if os.path.isdir(model_dir) else
            "is a file, expected a folder" if os.path.exists(model_dir) else "does not exist")
    if os.path.isdir(model_dir):
        ggufs = sorted(n for n in os.listdir(model_dir) if n.endswith(".gguf"))
        if ggufs:
            what += (f" but holds GGUF file(s) ({', '.join(ggufs[:3])}): pass the file itself, "
                     f"e.g. {os.path.join(model_dir, ggufs[0])!r}")
    raise UnsupportedModelError(
        f"model must be a local Hugging Face model folder (config.json, *.safetensors, "
        f"tokenizer files), got {model_dir!r}, which {what}; nybble does not download "
        f"from model hubs")


def model_weight_files(model_dir: str) -> list[str]:
    """The checkpoint files of a model folder, and no other ``*.safetensors`` in it
    (reference outputs, adapters): the files of ``model.safetensors.index.json``; else
    ``model.safetensors``; else every shard ``model-i-of-n.safetensors``; else the file that
    AutoGPTQ names in ``quantize_config.json`` (``model_file_base_name``) or by default
    (``gptq_model-4bit-128g.safetensors``, ``gptq_model-4bit--1g.safetensors``).

    Cheap (reads only the index and ``quantize_config.json``).

    Raises:
        UnsupportedModelError: no weight file, only pickle checkpoints (``*.bin``, ``*.pt``:
            they can run code when loaded), an index naming a file outside the folder or a
            missing file, or an incomplete set of shards.
        ValueError: the index is not JSON.
    """
    index = os.path.join(model_dir, WEIGHTS_INDEX)
    if os.path.isfile(index):
        weight_map = read_json(index)
        if weight_map is None:
            raise UnsupportedModelError(f"{WEIGHTS_INDEX} must hold a JSON object, in "
                                        f"{model_dir!r}")
        names = sorted(set(weight_map.get("weight_map", {}).values()))
        for name in names:
            norm = os.path.normpath(name) if isinstance(name, str) else ".."
            if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
                raise UnsupportedModelError(f"{WEIGHTS_INDEX} must name weight files inside "
                                            f"the model folder {model_dir!r}, got {name!r}")
        return _existing(model_dir, names, WEIGHTS_INDEX)
    files = os.listdir(model_dir)
    if "model.safetensors" in files:
        return [os.path.join(model_dir, "model.safetensors")]
    shards = sorted(f for f in files if _SHARD.fullmatch(f))
    if shards:
        total = int(_SHARD.fullmatch(shards[0]).group(2))  # type: ignore[union-attr]
        want = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
        return _existing(model_dir, want, f"the shard names ({shards[0]})")
    quantize_config = read_json(os.path.join(model_dir, "quantize_config.json"), lenient=True)
    base = (quantize_config or {}).get("model_file_base_name")
    named = [f"{base}.safetensors"] if isinstance(base, str) and base else []
    autogptq = named or [f for f in sorted(files) if _AUTOGPTQ.fullmatch(f)][:1]
    if autogptq:
        return _existing(model_dir, autogptq, "quantize_config.json")
    pickles = [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
    others = sorted(f for f in files if f.endswith(".safetensors"))
    what = ("only pickle checkpoints (refused: they can run code)" if pickles else
            f"only {others} (not weight files)" if others else "no weight files")
    raise UnsupportedModelError(f"model folder must contain model.safetensors, "
                                f"model-*-of-*.safetensors shards or {WEIGHTS_INDEX}, found "
                                f"{what} in {model_dir}")


def _existing(model_dir: str, names: list[str], source: str) -> list[str]:
    paths = [os.path.join(model_dir, n) for n in names]
    missing = [n for n, p in zip(names, paths) if not os.path.isfile(p)]
    if missing:
        raise UnsupportedModelError(f"the weight files named by {source} must exist in "
                                    f"{model_dir}, missing {missing[:3]}")
    return paths
