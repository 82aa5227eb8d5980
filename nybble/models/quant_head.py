"""A quantized output head read from a Hugging Face checkpoint (GPTQModel's ``lm_head: true``,
and ``nybble quantize --quantize-lm-head``): ``lm_head.qweight`` / ``qzeros`` / ``scales`` /
``g_idx`` in the checkpoint's own format, run by the same quantized linear module (and CPU
kernels) as the decoder layers, instead of a float ``[vocab, hidden]`` matrix.

The head is the largest single weight of a small model (SmolLM2-135M: 49152 x 576, 113 MB in
float32, read on every decode step); stored as INT8 g32 it is 30 MB.
"""
from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn

from nybble.errors import UnsupportedModelError
from nybble.quant.config import QuantConfig

HEAD = "lm_head"


def quantized_head(quant: QuantConfig | None, files: list[str], hidden: int, vocab: int,
                   dtype: torch.dtype, device: torch.device, sharded: bool) -> nn.Module | None:
    """The quantized head of the checkpoint, loaded, or None when ``quant`` keeps it dense.

    Args:
        quant: the checkpoint's quantization config (None: not quantized).
        files: its safetensors files. hidden, vocab: the head's ``[vocab, hidden]`` shape.
        sharded: tensor parallelism is on (the quantized head runs on one rank only).

    Raises:
        UnsupportedModelError: the config quantizes ``lm_head`` but the checkpoint holds no
            ``lm_head.*`` tensors, under tensor parallelism, or tensors of the wrong shape.
    """
    if quant is None or quant.layer_params(HEAD) is None:
        return None
    if sharded:
        raise UnsupportedModelError("a quantized lm_head needs tensor_parallel_size 1 (its "
                                    "vocabulary rows are not split yet)")
    head = quant.linear_factory([HEAD], hidden, [vocab], False, dtype, device)
    if head is None:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.startswith(HEAD + "."):
                    tensors[key.removeprefix(HEAD + ".")] = f.get_tensor(key)
    if not tensors or "weight" in tensors:
        raise UnsupportedModelError(
            f"the quantization config quantizes {HEAD}, but the checkpoint holds "
            f"{'a float lm_head.weight' if tensors else 'no lm_head.* tensors'}")
    try:
        head.load_tensors(tensors)
    except ValueError as e:
        raise UnsupportedModelError(f"{HEAD}: {e}") from e
    return head
