"""The transformers fallback for a tokenizer folder without ``tokenizer.json``.

Engine-core and offline side only: transformers' tokenizer machinery is heavy (and may import
torch), so the API process never imports this module; the core converts the folder's slow
tokenizer (sentencepiece ``tokenizer.model``, ...) to the ``tokenizers`` pipeline and sends the
JSON text in its start-up handshake.
"""
from __future__ import annotations

import os

from nybble.model_files import has_tokenizer_file
from nybble.tokenizer.tokenizer import Tokenizer


def fast_tokenizer_json(folder: str) -> str:
    """The folder's tokenizer as ``tokenizer.json`` text, converted by transformers.

    The side folder of a GGUF file (:mod:`nybble.gguf.side_folder`) is built from the GGUF
    metadata (transformers' GGUF tokenizer support; no weight is read) and the result is
    stored there as ``tokenizer.json``.

    Raises:
        ValueError: transformers cannot build a fast tokenizer for the folder.
    """
    from transformers import AutoTokenizer

    from nybble.gguf.side_folder import gguf_source, store_tokenizer_json

    source = gguf_source(folder)
    if source is not None:
        hf = AutoTokenizer.from_pretrained(os.path.dirname(source),
                                           gguf_file=os.path.basename(source))
        text = str(hf.backend_tokenizer.to_str())
        store_tokenizer_json(folder, text)
        return text
    hf = AutoTokenizer.from_pretrained(folder)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer must be convertible to a fast (tokenizers) tokenizer, "
                         f"got {type(hf).__name__} in {folder!r}")
    return str(backend.to_str())


def load_tokenizer(folder: str) -> tuple[Tokenizer, str | None]:
    """The folder's :class:`Tokenizer`, and the converted JSON text when the folder has no
    ``tokenizer.json`` (``None`` otherwise)."""
    converted = None if has_tokenizer_file(folder) else fast_tokenizer_json(folder)
    return Tokenizer.from_folder(folder, converted), converted
