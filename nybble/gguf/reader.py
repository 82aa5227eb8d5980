"""Open a GGUF file (one file, or the shards of a split model) and list its tensors.

Format: ggml's ``docs/gguf.md`` (magic ``GGUF``, version, tensor and key/value counts, the
metadata, the tensor directory, aligned tensor data); parsing is gguf-py's ``GGUFReader``.
Shards follow llama.cpp's ``gguf-split`` naming, ``NAME-00001-of-00003.gguf``, with the
metadata key ``split.count``; every shard holds its own tensors.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from nybble.errors import UnsupportedModelError

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")


def is_gguf_path(path: str) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` extension)."""
    return path.lower().endswith(".gguf")


def shard_paths(path: str) -> list[str]:
    """The files of the model ``path`` names: ``[path]``, or every shard of a split model
    (named ``NAME-0000i-of-0000n.gguf``), first shard first.

    Raises:
        UnsupportedModelError: a shard is missing (its name and the folder are given).
    """
    m = _SPLIT.fullmatch(os.path.basename(path))
    if m is None:
        return [path]
    folder, total = os.path.dirname(path), int(m.group(3))
    names = [f"{m.group(1)}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise UnsupportedModelError(
            f"a split GGUF model needs all {total} of its shards in one folder, missing "
            f"{missing[:3]} in {folder or '.'!r} (merge them with llama.cpp's gguf-split "
            f"--merge, or copy every shard)")
    return [os.path.join(folder, n) for n in names]


def check_gguf_file(path: str) -> None:
    """Cheap start-up check of a GGUF model path: it exists, every shard is there, and each
    starts with the GGUF magic and a supported version (2 or 3).

    Raises:
        UnsupportedModelError: any of these fails (one line naming the file).
    """
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        raise UnsupportedModelError(f"model must be a local GGUF file or Hugging Face model "
                                    f"folder, got {path!r}, which {what}")
    for p in shard_paths(path):
        with open(p, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise UnsupportedModelError(f"{p!r} is not a GGUF file: it must start with the "
                                        f"magic {GGUF_MAGIC!r}, got {head[:4]!r}")
        version = struct.unpack("<I", head[4:8])[0]
        if version not in (2, 3):
            raise UnsupportedModelError(f"GGUF version must be 2 or 3, got {version} in {p!r}")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: its GGUF name (``blk.0.attn_q.weight``).
        type_name: ggml type (``Q4_K``, ``F32``...). type_id: its ``GGMLQuantizationType``.
        shape: ``(ne1, ne0)`` rows-first (``ne0``, the fastest axis, is the input features).
        data: the raw data as gguf-py maps it: ``uint8 [rows, bytes_per_row]`` for block
            types, the float array for F32/F16 (``uint8`` pairs for BF16).
    """

    name: str
    type_name: str
    type_id: int
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """The metadata and tensors of a GGUF model (all shards).

    Args:
        path: the ``.gguf`` file (the first shard of a split model, or any shard).

    Raises:
        UnsupportedModelError: bad magic or version, a truncated file, a missing shard, or
            a file gguf-py cannot parse (the message names the file and the reason).
    """

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader

        check_gguf_file(path)
        self.path = path
        self.paths = shard_paths(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for i, p in enumerate(self.paths):
            size = os.path.getsize(p)
            try:
                reader = GGUFReader(p)
            except (ValueError, IndexError, struct.error, OSError) as e:
                raise UnsupportedModelError(f"GGUF file {p!r} cannot be read (truncated or "
                                            f"corrupt?): {e}") from e
            if i == 0:
                for key, field in reader.fields.items():
                    self.metadata[key] = _field_value(field)
            for t in reader.tensors:
                end = int(t.data_offset) + int(t.n_bytes)
                if end > size or t.data.nbytes != int(t.n_bytes):
                    raise UnsupportedModelError(
                        f"GGUF file {p!r} is truncated: tensor {t.name} needs bytes up to "
                        f"{end}, the file has {size}")
                shape = tuple(int(d) for d in reversed(list(t.shape)))
                self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name,
                                                  int(t.tensor_type), shape, t.data)
        split = int(self.metadata.get("split.count", 1) or 1)
        if split != len(self.paths):
            raise UnsupportedModelError(
                f"GGUF file {path!r} is shard 1 of a {split}-way split model (split.count); "
                f"its shards must be named NAME-0000i-of-{split:05d}.gguf side by side")

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``...)."""
        return str(self.metadata.get("general.architecture", ""))


def _field_value(field: Any) -> Any:
    """A metadata value as Python data (strings, numbers, lists); large token arrays stay
    lists of str/int/float."""
    return field.contents()


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata key/values of a GGUF model (first shard), without keeping the file open.

    Raises:
        UnsupportedModelError: as :class:`GGUFFile`.
    """
    return GGUFFile(path).metadata
