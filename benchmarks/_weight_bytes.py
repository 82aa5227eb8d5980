"""Bytes of weights one decode step reads, counted from the model files as stored.

One decoded token multiplies its hidden state by every linear layer once (attention and MLP
projections: the packed weights plus their scales and zero points) and by the output head, and
applies the norms. The embedding table is only looked up (one row per token), so it counts only
when it *is* the head (tied embeddings, one stored table). These bytes over the memory bandwidth
of one core are the batch-1 decode limit ("weight-bandwidth limit"): a step cannot finish before
its weights have streamed from memory.

Two readers:

* :func:`safetensors_weight_bytes`: a Hugging Face folder (``config.json`` + ``*.safetensors``),
  dense or GPTQ-packed (``qweight`` / ``qzeros`` / ``scales``; ``g_idx`` is listed apart and not
  counted: with ``desc_act`` off it is the identity order, which a kernel need not read). Sizes
  come from the safetensors header's ``data_offsets`` (the format spec:
  8-byte little-endian header length, then a JSON header), so no tensor is loaded.
* :func:`gguf_weight_bytes`: a GGUF file, sizes from gguf-py's ``GGUFReader`` (each tensor's
  ``n_bytes`` as stored, e.g. Q4_0: 18 bytes per 32 weights). ``output.weight`` is the head; when
  it is absent the head is ``token_embd.weight`` (llama.cpp's tied case).
"""
from __future__ import annotations

import glob
import json
import os
import struct
import sys
from typing import Any

_EMBED = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


def safetensors_sizes(path: str) -> dict[str, tuple[str, int]]:
    """``{tensor name: (dtype, bytes)}`` of one ``.safetensors`` file, read from its header.

    Raises:
        ValueError: the file is shorter than its declared header (not a safetensors file).
    """
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", raw)
        header = f.read(n)
    if len(header) != n:
        raise ValueError(f"{path} is not a safetensors file: header of {n} bytes declared, "
                         f"{len(header)} present")
    meta = json.loads(header)
    return {name: (info["dtype"], int(info["data_offsets"][1]) - int(info["data_offsets"][0]))
            for name, info in meta.items() if name != "__metadata__"}


def _category(name: str) -> str:
    if name.endswith(".g_idx"):
        return "g_idx"
    if name.endswith(("norm.weight", "norm.bias")):
        return "norm"
    return "linear"


def safetensors_weight_bytes(folder: str) -> dict[str, Any]:
    """Per-token weight bytes of a Hugging Face Llama folder (dense or GPTQ).

    Returns a dict: ``per_token_bytes`` (linear + norm + head), ``linear_bytes`` (every
    projection's stored tensors: weight, or qweight + qzeros + scales), ``norm_bytes``,
    ``head_bytes`` and ``head_dtype`` (``lm_head.weight``, a quantized ``lm_head.*``, or the
    embedding when tied),
    ``tied``, ``embedding_bytes`` (the table, not counted unless tied), ``g_idx_bytes`` (not
    counted), ``file_bytes`` (all tensors).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``folder``.
        ValueError: neither an ``lm_head.weight``, a quantized ``lm_head.*`` nor tied
            embeddings give a head.
    """
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    sizes: dict[str, tuple[str, int]] = {}
    for path in files:
        sizes.update(safetensors_sizes(path))
    with open(os.path.join(folder, "config.json")) as f:
        tied = bool(json.load(f).get("tie_word_embeddings", False))
    qhead = {n: v for n, v in sizes.items() if n.startswith("lm_head.") and n != _HEAD}
    head_name = _EMBED if tied or _HEAD not in sizes else _HEAD
    if not qhead and (head_name not in sizes or (head_name == _EMBED and not tied)):
        raise ValueError(f"{folder}: no output head (no {_HEAD}, no quantized lm_head.* and "
                         f"tie_word_embeddings is not set)")
    totals = {"linear": 0, "norm": 0, "g_idx": 0}
    for name, (_, nbytes) in sizes.items():
        if name not in (_EMBED, _HEAD) and name not in qhead:
            totals[_category(name)] += nbytes
    if qhead:   # a quantized head (GPTQModel lm_head: true): its stored tensors, g_idx aside
        head_dtype = "quantized " + sizes.get("lm_head.qweight", ("?", 0))[0]
        head_bytes = sum(n for k, (_, n) in qhead.items() if not k.endswith(".g_idx"))
    else:
        head_dtype, head_bytes = sizes[head_name]
    return {"per_token_bytes": totals["linear"] + totals["norm"] + head_bytes,
            "linear_bytes": totals["linear"], "norm_bytes": totals["norm"],
            "head_bytes": head_bytes, "head_dtype": head_dtype, "tied": tied,
            "embedding_bytes": sizes.get(_EMBED, ("", 0))[1], "g_idx_bytes": totals["g_idx"],
            "file_bytes": sum(n for _, n in sizes.values())}


def import_gguf(llama_dir: str | None = None) -> Any:
    """The ``gguf`` module: installed, else the ``gguf-py`` of a llama.cpp source tree.

    Raises:
        ImportError: neither is there (install ``gguf`` or pass the llama.cpp folder).
    """
    try:
        import gguf
        return gguf
    except ImportError:
        if llama_dir is None or not os.path.isdir(os.path.join(llama_dir, "gguf-py")):
            raise ImportError("reading GGUF sizes needs the gguf module: pip install gguf, or "
                              "give the llama.cpp source folder (its gguf-py is used)") from None
        sys.path.insert(0, os.path.join(llama_dir, "gguf-py"))
        import gguf
        return gguf


def gguf_weight_bytes(path: str, llama_dir: str | None = None) -> dict[str, Any]:
    """Per-token weight bytes of a GGUF model file (same keys as
    :func:`safetensors_weight_bytes`; ``head_dtype`` is the GGML type name, e.g. ``Q8_0``).

    Raises:
        ValueError: the file has neither ``output.weight`` nor ``token_embd.weight``.
    """
    reader = import_gguf(llama_dir).GGUFReader(path)
    sizes = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors}
    head_name = "output.weight" if "output.weight" in sizes else "token_embd.weight"
    if head_name not in sizes:
        raise ValueError(f"{path}: no output.weight and no token_embd.weight")
    linear = norm = 0
    for name, (_, nbytes) in sizes.items():
        if name in ("output.weight", "token_embd.weight"):
            continue
        if name.endswith("norm.weight"):
            norm += nbytes
        else:
            linear += nbytes
    head_dtype, head_bytes = sizes[head_name]
    return {"per_token_bytes": linear + norm + head_bytes, "linear_bytes": linear,
            "norm_bytes": norm, "head_bytes": head_bytes, "head_dtype": head_dtype,
            "tied": head_name == "token_embd.weight",
            "embedding_bytes": sizes.get("token_embd.weight", ("", 0))[1], "g_idx_bytes": 0,
            "file_bytes": sum(n for _, n in sizes.values())}
