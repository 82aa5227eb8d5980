"""Write nybble's quantization results as a GGUF file that llama.cpp loads
(``nybble quantize --format gguf``).

The container is written by gguf-py's ``GGUFWriter`` (PyPI ``gguf``); the block bytes are
built here with numpy from nybble's integer codes, following the block layouts of ggml's
``ggml-common.h`` (one block = 32 consecutive input features of one row):

* ``Q4_0`` (18 bytes): fp16 ``d``, then 16 bytes whose low nibbles hold elements 0..15 and high
  nibbles elements 16..31; ``y = d * (nibble - 8)``. From a symmetric 4-bit g32 result
  (``zero = 8``): ``d = scale``, ``nibble = q``. Exact.
* ``Q4_1`` (20 bytes): fp16 ``d``, fp16 ``m``, the same 16 nibble bytes; ``y = d * nibble + m``.
  From an asymmetric 4-bit g32 result (GPTQ/RTN/GPTQ-E2E asymmetric, AWQ 4-bit):
  ``d = scale``, ``nibble = q``, ``m = -scale * zero`` rounded to fp16. **That rounding of m is
  the one inexact step of the export** (``scale * zero`` needs up to 15 significant bits, fp16
  keeps 11): every weight of the block moves by the same ``|m - (-scale*zero)|``, at most half
  an fp16 ulp of ``m``.
* ``Q8_0`` (34 bytes): fp16 ``d``, 32 int8; ``y = d * int8``. From a symmetric 8-bit g32 result
  (``zero = 128``): ``d = scale``, ``int8 = q - 128`` (-128 included). Exact.

nybble's scales are already fp16 values (what its checkpoints store), so ``d`` is the scale
itself; the integers are never recomputed from floats. Anything else (group size other than
32, act order with a non-trivial ``g_idx``, 8-bit asymmetric) is refused with a ValueError
(:data:`ALLOWED`). Dense tensors: norms F32; embedding, output head and Linears left dense F32
(F16 or BF16 when the source model is stored in that dtype and the tensor holds it exactly).

Names and layout follow llama.cpp's converter for the ``llama`` and ``qwen2`` architectures
(``token_embd``, ``blk.N.attn_q`` ... ``output_norm``, ``output`` when untied;
:func:`nybble.models.gguf_loader.gguf_name`); for ``llama`` the rows of ``attn_q``/``attn_k``
are permuted per head (:func:`rope_row_order`), which llama.cpp's RoPE and nybble's GGUF loader
both expect. Tokenizer metadata: :mod:`nybble.quantize.gguf_vocab`.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from nybble import __version__
from nybble.models.gguf_loader import gguf_name
from nybble.quantize.gguf_vocab import add_tokenizer
from nybble.quantize.gptq import GPTQResult

logger = logging.getLogger(__name__)

QK = 32
"""Elements per block of Q4_0 / Q4_1 / Q8_0 (ggml's ``QK4_0``, ``QK4_1``, ``QK8_0``)."""
ALLOWED = ("GGUF export maps group size 32 without act order (or act order with static "
           "groups) from: 4-bit symmetric -> Q4_0, 4-bit asymmetric (rtn/gptq/gptq-e2e "
           "without --sym, awq) -> Q4_1, 8-bit symmetric -> Q8_0")
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
"""HF ``model_type`` -> GGUF ``general.architecture``."""
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # gguf.LlamaFileType MOSTLY_*


def block_type(bits: int, sym: bool) -> str:
    """The GGUF type of a ``bits``-bit g32 result: ``Q4_0`` / ``Q4_1`` / ``Q8_0``.

    Raises:
        ValueError: 8-bit asymmetric or other bits (:data:`ALLOWED`).
    """
    if bits == 4:
        return "Q4_0" if sym else "Q4_1"
    if bits == 8 and sym:
        return "Q8_0"
    what = "8-bit asymmetric (awq 8-bit, or no --sym)" if bits == 8 else f"{bits}-bit"
    raise ValueError(f"{what} has no exact GGUF block type; {ALLOWED}")


def check_gguf_options(bits: int, group_size: int, sym: bool, desc_act: bool,
                       static_groups: bool) -> str:
    """The GGUF type a run with these settings writes, checked before quantizing.

    Raises:
        ValueError: a setting that cannot map exactly (the message names the allowed ones).
    """
    if group_size != QK:
        raise ValueError(f"--group-size must be {QK} for --format gguf (its blocks hold {QK} "
                         f"weights with one scale), got {group_size}; {ALLOWED}")
    if desc_act and not static_groups:
        raise ValueError(f"act order (--desc-act) without --static-groups gives a non-trivial "
                         f"g_idx, which GGUF blocks cannot hold: pass --no-desc-act (or add "
                         f"--static-groups); {ALLOWED}")
    return block_type(bits, sym)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """``float [..., G]`` -> ``uint8 [..., G, 2]``, little-endian fp16."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(*x.shape, 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """``int [..., 32]`` in 0..15 -> ``uint8 [..., 16]``: byte j holds element j (low nibble)
    and element j + 16 (high nibble)."""
    q = q.astype(np.uint8)
    return q[..., :QK // 2] | (q[..., QK // 2:] << 4)


def encode_blocks(res: GPTQResult, bits: int, sym: bool) -> tuple[str, np.ndarray]:
    """The GGUF blocks of one quantized Linear, exactly from its integer codes.

    Args:
        res: ``q int32 [N, K]``, ``scale, zero float32 [N, K/32]`` (fp16-valued scales),
            ``g_idx [K]`` (must be ``k // 32``). bits, sym: the grid ``res`` was made on.

    Returns:
        ``(type name, uint8 [N, K/32 * block bytes])``, rows in the Linear's order.

    Raises:
        ValueError: a group size other than 32, a non-trivial ``g_idx``, scales that are
            not fp16 values, a symmetric zero point other than ``2^(bits-1)``, codes out of
            range, an ``m`` that overflows fp16, or settings without a block type.
    """
    kind = block_type(bits, sym)
    q = res.q.detach().cpu().numpy().astype(np.int64)
    scale = res.scale.detach().cpu().float().numpy()
    zero = res.zero.detach().cpu().float().numpy()
    n, k = q.shape
    if k % QK or scale.shape != (n, k // QK):
        raise ValueError(f"a [{n}, {k}] weight with {scale.shape[1]} groups is not group size "
                         f"{QK}; {ALLOWED}")
    if not np.array_equal(res.g_idx.cpu().numpy(), np.arange(k) // QK):
        raise ValueError(f"g_idx is not k // {QK} (act order regroups the columns), which GGUF "
                         f"blocks cannot hold; {ALLOWED}")
    if not np.array_equal(scale.astype(np.float16).astype(np.float32), scale):
        raise ValueError("scales must be float16 values (as nybble's quantizers store them)")
    if q.min() < 0 or q.max() >= (1 << bits):
        raise ValueError(f"codes must lie in 0..{(1 << bits) - 1}, got {q.min()}..{q.max()}")
    if sym and not np.all(zero == 1 << (bits - 1)):
        raise ValueError(f"a symmetric {bits}-bit result must have zero point "
                         f"{1 << (bits - 1)} everywhere")
    blocks = q.reshape(n, k // QK, QK)
    d = _fp16_bytes(scale)
    if kind == "Q4_0":
        out = np.concatenate([d, _nibbles(blocks)], axis=2)
    elif kind == "Q4_1":
        m = -(scale * zero)   # NOTE: exact in float32 (11 x 4 significant bits)
        if not np.all(np.isfinite(m.astype(np.float16))):
            raise ValueError("-scale * zero overflows float16 (Q4_1's m)")
        out = np.concatenate([d, _fp16_bytes(m), _nibbles(blocks)], axis=2)
    else:
        codes = (blocks - 128).astype(np.int8).view(np.uint8)
        out = np.concatenate([d, codes], axis=2)
    return kind, np.ascontiguousarray(out.reshape(n, -1))


def rope_row_order(rows: int, heads: int) -> np.ndarray:
    """The HF rows of a llama ``attn_q``/``attn_k`` in GGUF order: ``gguf = hf[order]``.

    Within each head of ``D = rows / heads`` rows, GGUF row ``2i + j`` is HF row
    ``j * D/2 + i`` (llama.cpp's RoPE rotates adjacent pairs, HF's ``rotate_half`` the two
    halves of a head). Whole rows move, so quantized rows are permuted as they are.
    """
    d = rows // heads
    return np.arange(rows).reshape(heads, 2, d // 2).transpose(0, 2, 1).reshape(-1)


def _config_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ValueError(f"config.json must set {key!r} for a GGUF export")
    return int(value)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope theta, scaling or None)`` from ``rope_theta`` / ``rope_scaling`` or
    transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type") or scaling.get("type")
    return theta, (None if kind in (None, "default") else scaling)


def check_gguf_config(cfg: dict[str, Any]) -> str:
    """The GGUF architecture of a Hugging Face ``config.json``, checked before quantizing.

    Raises:
        ValueError: a ``model_type`` other than :data:`ARCHITECTURES`, an activation other
            than SiLU, RoPE scaling other than linear (Llama 3's needs a frequency tensor),
            or a Qwen2 sliding window.
    """
    model_type = str(cfg.get("model_type"))
    if model_type not in ARCHITECTURES:
        raise ValueError(f"GGUF export supports model_type {', '.join(ARCHITECTURES)}, got "
                         f"{model_type!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"GGUF export supports the SiLU-gated MLP (hidden_act silu), got "
                         f"{act!r}")
    _, scaling = _rope(cfg)
    if scaling is not None and (scaling.get("rope_type") or scaling.get("type")) != "linear":
        raise ValueError(f"GGUF export supports default and linear RoPE, got "
                         f"{scaling.get('rope_type') or scaling.get('type')!r}")
    if cfg.get("use_sliding_window"):
        raise ValueError("GGUF export of qwen2 supports full attention only "
                         "(use_sliding_window false)")
    return ARCHITECTURES[model_type]


def _add_metadata(w: Any, cfg: dict[str, Any], arch: str, name: str, ftype: int) -> None:
    import gguf

    hidden = _config_int(cfg, "hidden_size")
    heads = _config_int(cfg, "num_attention_heads")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    w.add_type("model")
    w.add_name(name)
    w.add_quantized_by(f"nybble {__version__}")
    w.add_context_length(_config_int(cfg, "max_position_embeddings"))
    w.add_embedding_length(hidden)
    w.add_block_count(_config_int(cfg, "num_hidden_layers"))
    w.add_feed_forward_length(_config_int(cfg, "intermediate_size"))
    w.add_head_count(heads)
    w.add_head_count_kv(_config_int(cfg, "num_key_value_heads", heads))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    theta, scaling = _rope(cfg)
    w.add_rope_freq_base(theta)
    if scaling is not None:   # linear (check_gguf_config)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(_config_int(cfg, "vocab_size"))
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _source_dtype(cfg: dict[str, Any]) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")


def dense_tensor(t: torch.Tensor, source_dtype: str) -> tuple[str, np.ndarray]:
    """``(type name, array)`` of a float tensor: F32 for 1-D tensors (norms, biases) and in
    general; F16 / BF16 for a matrix of a ``float16`` / ``bfloat16`` source model when the
    tensor holds exactly such values."""
    t = t.detach().cpu().float().contiguous()
    if t.dim() > 1 and source_dtype in ("float16", "bfloat16"):
        low = t.to(torch.float16 if source_dtype == "float16" else torch.bfloat16)
        if torch.equal(low.float(), t):
            if source_dtype == "float16":
                return "F16", low.numpy()
            return "BF16", low.view(torch.int16).numpy().view(np.uint16)
    return "F32", t.numpy()


class _TensorPlan:
    """The tensors of the file, by GGUF name: ``(type name, array)``."""

    def __init__(self, cfg: dict[str, Any], arch: str) -> None:
        self.arch = arch
        self.heads = _config_int(cfg, "num_attention_heads")
        self.kv_heads = _config_int(cfg, "num_key_value_heads", self.heads)
        self.tensors: dict[str, tuple[str, np.ndarray]] = {}

    def add(self, hf_name: str, kind: str, data: np.ndarray) -> None:
        prefix, _, leaf = hf_name.rpartition(".")
        base = gguf_name(prefix)
        if base == prefix or leaf not in ("weight", "bias"):
            raise ValueError(f"tensor {hf_name!r} has no GGUF name (architectures: "
                             f"{', '.join(ARCHITECTURES)})")
        if self.arch == "llama" and base.endswith((".attn_q", ".attn_k")):
            heads = self.heads if base.endswith(".attn_q") else self.kv_heads
            data = data[rope_row_order(data.shape[0], heads)]
        self.tensors[f"{base}.{leaf}"] = (kind, np.ascontiguousarray(data))


def _file_order(name: str) -> tuple[int, int, str]:
    """token_embd, then the blocks in order, then output_norm and output."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def write_gguf(path: str, tensors: dict[str, torch.Tensor], hf_config: dict[str, Any],
               model_dir: str, results: dict[str, GPTQResult], bits: int, sym: bool,
               head: GPTQResult | None = None, name: str | None = None) -> dict[str, Any]:
    """Write the GGUF file ``path`` (atomically: a temporary file renamed into place).

    Args:
        tensors: the model's float tensors by Hugging Face name (``model.state_dict()``);
            the ``.weight`` of a Linear in ``results`` is ignored, a tied ``lm_head.weight``
            too. hf_config: the source ``config.json``. model_dir: the folder whose tokenizer
            files and chat template go into the metadata.
        results: quantized Linears by module prefix (``model.layers.0.self_attn.q_proj``),
            made on the ``bits`` / ``sym`` grid with group size 32.
        head: the output head quantized RTN symmetric 8-bit g32 (written as ``output``
            Q8_0, the embedding kept dense), or None.
        name: ``general.name`` (default: the folder's name).

    Returns:
        ``{"types": {gguf tensor name: type}, "quantized_bytes": bytes of the quantized
        tensors, "file_bytes": size of the file, "file_type": the GGUF type of the Linears}``.

    Raises:
        ValueError: a config that does not map (:func:`check_gguf_config`), a result that
            cannot map exactly (:func:`encode_blocks`), a tensor without a GGUF name, or no
            usable tokenizer.
    """
    import gguf

    arch = check_gguf_config(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False)) and head is None
    plan = _TensorPlan(hf_config, arch)
    layer_type = block_type(bits, sym)
    quantized_bytes = 0
    for prefix, res in sorted(results.items()):
        kind, blocks = encode_blocks(res, bits, sym)
        plan.add(prefix + ".weight", kind, blocks)
        quantized_bytes += blocks.nbytes
    if head is not None:
        kind, blocks = encode_blocks(head, 8, True)
        plan.add("lm_head.weight", kind, blocks)
        quantized_bytes += blocks.nbytes
    src = _source_dtype(hf_config)
    for hf_name, t in tensors.items():
        prefix, _, leaf = hf_name.rpartition(".")
        if ("rotary_emb" in hf_name or (prefix in results and leaf == "weight")
                or (prefix == "lm_head" and (tied or head is not None))):
            continue
        plan.add(hf_name, *dense_tensor(t, src))
    if not tied and "output.weight" not in plan.tensors:
        raise ValueError("an untied model needs lm_head.weight among the tensors")
    name = name or os.path.basename(os.path.normpath(model_dir))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    try:
        _add_metadata(w, hf_config, arch, name, _FILE_TYPES[layer_type] if results else 0)
        add_tokenizer(w, model_dir, _config_int(hf_config, "vocab_size"))
        for tname in sorted(plan.tensors, key=_file_order):
            kind, data = plan.tensors[tname]
            w.add_tensor(tname, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"types": {n: kind for n, (kind, _) in plan.tensors.items()},
            "quantized_bytes": quantized_bytes, "file_bytes": os.path.getsize(path),
            "file_type": layer_type}
