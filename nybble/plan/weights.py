"""Weight bytes of a checkpoint, from its safetensors headers (no tensor is loaded).

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
each tensor's ``dtype``, ``shape`` and ``data_offsets`` (the safetensors format spec). The
planner reads the header only, so it sizes a 70B checkpoint in milliseconds. For model shapes
without a checkpoint (the docs' GPU table), :func:`llama_gptq_tensors` writes the header a
GPTQ (or fp16) export of a Llama of that shape would have.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from nybble.model_files import model_weight_files

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""Bytes per element of each safetensors dtype."""
_FLOATS = ("F64", "F32", "F16", "BF16")
_SERVE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint header: safetensors ``dtype`` name and ``shape``."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: str) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, from its header alone.

    Raises:
        ValueError: the file is not a safetensors file (short, or a header that is not JSON).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} must be a safetensors file, got {len(head)} bytes")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ValueError(f"{path} must be a safetensors file: its header is not JSON "
                             f"({e})") from None
    return {name: TensorInfo(str(v["dtype"]), tuple(int(d) for d in v["shape"]))
            for name, v in header.items() if name != "__metadata__"}


def checkpoint_tensors(model_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of a model folder's checkpoint files (``model_weight_files``).

    Raises:
        UnsupportedModelError: no weight files (see ``model_weight_files``).
        ValueError: a file that is not safetensors.
    """
    tensors: dict[str, TensorInfo] = {}
    for path in model_weight_files(model_dir):
        tensors.update(read_header(path))
    return tensors


def gguf_tensors(path: str) -> dict[str, TensorInfo]:
    """Every tensor of a GGUF model (all shards) in :func:`checkpoint_tensors`' terms: float
    tensors (F32/F16/BF16/F64) with their element shape, so they count at the serving dtype;
    block-quantized ones (Q4_0, Q4_K, Q8_0, ...) as ``U8 [rows, bytes per row]``, their bytes
    as stored (ggml's block layout: the engine keeps each format's packed integers and
    scales, so the stored size is the weight's size within a few per cent).

    Raises:
        UnsupportedModelError: not a readable GGUF file (:class:`nybble.gguf.reader.GGUFFile`).
    """
    from nybble.gguf.reader import GGUFFile

    out: dict[str, TensorInfo] = {}
    for name, t in GGUFFile(path).tensors.items():
        if t.type_name in _FLOATS:
            out[name] = TensorInfo(t.type_name, t.shape)
        else:
            rows = t.shape[0] if len(t.shape) > 1 else 1
            out[name] = TensorInfo("U8", (rows, int(t.data.nbytes) // rows))
    return out


def weight_bytes(tensors: dict[str, TensorInfo], dtype: str,
                 tensor_parallel_size: int = 1) -> int:
    """Bytes the engine holds for ``tensors`` on one rank: floating tensors at the serving
    ``dtype`` (weights are cast at load), integer tensors (packed quantized weights, zero
    points, ``g_idx``) as stored. With ``tensor_parallel_size`` > 1, 2-D+ tensors (the linear
    layers, embeddings and LM head) are split across ranks as Megatron-LM shards them and 1-D
    tensors (norms, biases, ``g_idx``) are counted whole on each rank (an upper bound).

    Raises:
        ValueError: an unknown ``dtype`` or tensor dtype.
    """
    if dtype not in _SERVE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(_SERVE_BYTES)}, got {dtype!r}")
    total = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name} must have a safetensors dtype "
                             f"({', '.join(DTYPE_BYTES)}), got {t.dtype!r}")
        elem = _SERVE_BYTES[dtype] if t.dtype in _FLOATS else DTYPE_BYTES[t.dtype]
        nbytes = t.numel * elem
        total += -(-nbytes // tensor_parallel_size) if len(t.shape) >= 2 else nbytes
    return total


def llama_gptq_tensors(config: dict, bits: int | None, group_size: int = 128
                       ) -> dict[str, TensorInfo]:
    """The tensors of a Llama checkpoint of ``config``'s shape (config.json fields): fp16
    throughout when ``bits`` is None, else the seven projections of each layer in the GPTQ
    layout (``qweight`` int32 ``[in * bits / 32, out]``, ``qzeros`` int32
    ``[in / g, out * bits / 32]``, ``scales`` fp16 ``[in / g, out]``, ``g_idx`` int32
    ``[in]``; AutoGPTQ's format), embeddings, norms and LM head in fp16.

    Raises:
        ValueError: ``bits`` not 4 or 8, or a projection width not a multiple of
            ``group_size``.
    """
    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be None (fp16), 4 or 8, got {bits}")
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    projections = {"self_attn.q_proj": (hidden, heads * head_dim),
                   "self_attn.k_proj": (hidden, kv_heads * head_dim),
                   "self_attn.v_proj": (hidden, kv_heads * head_dim),
                   "self_attn.o_proj": (heads * head_dim, hidden),
                   "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                   "mlp.down_proj": (inter, hidden)}
    out = {"model.embed_tokens.weight": TensorInfo("F16", (vocab, hidden)),
           "model.norm.weight": TensorInfo("F16", (hidden,))}
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = TensorInfo("F16", (vocab, hidden))
    for i in range(int(config["num_hidden_layers"])):
        pre = f"model.layers.{i}"
        out[f"{pre}.input_layernorm.weight"] = TensorInfo("F16", (hidden,))
        out[f"{pre}.post_attention_layernorm.weight"] = TensorInfo("F16", (hidden,))
        for proj, (n_in, n_out) in projections.items():
            if bits is None:
                out[f"{pre}.{proj}.weight"] = TensorInfo("F16", (n_out, n_in))
                continue
            if n_in % group_size:
                raise ValueError(f"group_size must divide {proj}'s {n_in} inputs, got "
                                 f"{group_size}")
            pack = 32 // bits
            out[f"{pre}.{proj}.qweight"] = TensorInfo("I32", (n_in // pack, n_out))
            out[f"{pre}.{proj}.qzeros"] = TensorInfo("I32", (n_in // group_size,
                                                             n_out // pack))
            out[f"{pre}.{proj}.scales"] = TensorInfo("F16", (n_in // group_size, n_out))
            out[f"{pre}.{proj}.g_idx"] = TensorInfo("I32", (n_in,))
    return out
