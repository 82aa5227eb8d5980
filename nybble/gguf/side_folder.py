"""The side folder of a GGUF model: the Hugging Face files its metadata stands for.

nybble's start-up reads a model's settings from ``config.json``, ``generation_config.json``
and ``tokenizer_config.json``; for a GGUF file these are written once, from its metadata
(:mod:`nybble.gguf.metadata`), into a cache folder keyed by the file's path, size and
modification time (``$NYBBLE_CACHE_DIR``, default ``~/.cache/nybble``, then ``gguf/``). The
weights stay in the GGUF file. ``gguf_source.json`` there names the file, so the engine core
can build ``tokenizer.json`` from the same metadata (with transformers' GGUF tokenizer
support, :mod:`nybble.tokenizer.hf_tokenizer`) and store it beside them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from nybble.gguf.metadata import generation_config, hf_config, tokenizer_config
from nybble.gguf.reader import GGUFFile

SOURCE_FILE = "gguf_source.json"
"""The side folder's record of its GGUF file (``{"gguf_file": absolute path}``)."""
_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", SOURCE_FILE)


def cache_root() -> str:
    """``$NYBBLE_CACHE_DIR`` or ``~/.cache/nybble``."""
    return os.environ.get("NYBBLE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "nybble")


def side_folder_path(gguf_path: str) -> str:
    """Where the side folder of ``gguf_path`` lives (a stat, no read)."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = hashlib.sha1(f"{real}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.basename(real)[:-len(".gguf")]
    return os.path.join(cache_root(), "gguf", f"{stem}-{key}")


def gguf_source(folder: str) -> str | None:
    """The GGUF file a side folder stands for, or None for any other folder."""
    path = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return str(json.load(f)["gguf_file"])


def ensure_side_folder(gguf_path: str) -> str:
    """The side folder of ``gguf_path``, written from its metadata if it is not there yet
    (atomically: a temporary folder renamed into place).

    Raises:
        UnsupportedModelError: the file is not a readable GGUF model of a supported
            architecture (:class:`~nybble.gguf.reader.GGUFFile`,
            :func:`~nybble.gguf.metadata.hf_config`).
    """
    folder = side_folder_path(gguf_path)
    if all(os.path.isfile(os.path.join(folder, n)) for n in _FILES):
        return folder
    gf = GGUFFile(gguf_path)
    meta = gf.metadata
    contents = {"config.json": hf_config(meta, gf.tensors),
                "generation_config.json": generation_config(meta),
                "tokenizer_config.json": tokenizer_config(meta),
                SOURCE_FILE: {"gguf_file": os.path.realpath(gguf_path)}}
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(folder))
    for name, value in contents.items():
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1)
    try:
        os.replace(tmp, folder)
    except OSError:   # NOTE: another process wrote it first (or a stale partial folder)
        if not all(os.path.isfile(os.path.join(folder, n)) for n in _FILES):
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def store_tokenizer_json(folder: str, text: str) -> None:
    """Write ``tokenizer.json`` into a side folder (atomically)."""
    fd, tmp = tempfile.mkstemp(prefix=".tok-", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, "tokenizer.json"))
