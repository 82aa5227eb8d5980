"""Linear modules holding GGUF weights in nybble's packed integer form.

A GGUF block type (:mod:`nybble.quant.gguf_blocks`) becomes a GPTQ-layout weight with
float32 group scales: ``qweight [K/pf, N]`` packed along K (docs/quant-formats.md §3.2),
``qzeros`` packed along N holding the type's fixed zero, and, for the types with a minimum
(Q4_1/Q4_K/Q5_1/Q5_K), ``mins [G, N]`` float32 (``W = s * q + m``). So the GPU runs the
Triton dequant-GEMM, the CPU the bf16-dot or the float32 weight-only kernel (both with the
minimums) and the reference dequantization where neither takes the layout, exactly as for a
GPTQ checkpoint.

A fused projection (q/k/v, gate/up) whose shards have different GGUF types (llama-quantize's
Q4_K_M puts some ``attn_v`` in Q6_K) is a :class:`GGUFLinear` of several parts, one per run
of equal types, whose outputs are concatenated.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from nybble.kernels import quant_ops
from nybble.kernels.packing import pack_cols, pack_factor, pack_rows, unpack_rows
from nybble.kernels.reference.quant import IntWeight, dequantize_int_weight, gptq_int_weight
from nybble.quant.gguf_blocks import GGUFInts
from nybble.quant.linear import CpuPathLog, GPTQLinear


class GGUFQuantLinear(GPTQLinear):
    """One GGUF quantized weight ``[N, K]`` (or several of one type, concatenated along N).

    Args:
        type_name: the GGUF type (for logs). bits, group_size: of its integer form.
        has_mins: the type has a per-group float minimum.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, type_name: str, bits: int, group_size: int,
                 has_mins: bool, path_log: CpuPathLog | None = None) -> None:
        super().__init__(in_features, out_features, False, dtype, device, bits, group_size, 0,
                         False, path_log)
        self.type_name = type_name
        self.register_buffer("mins", torch.zeros(self.num_groups, out_features,
                                                 device=self.device_) if has_mins else None)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super()._shapes(), "mins": (self.num_groups, self.out_features)}

    def load_ints(self, ints: GGUFInts) -> None:
        """Take the unpacked integers ``[N, K]`` (:func:`~nybble.quant.gguf_blocks.unpack_blocks`).

        Raises:
            ValueError: shapes, bits or group size that differ from the module's.
        """
        if (ints.bits, ints.group_size) != (self.bits, self.group_size):
            raise ValueError(f"{self.type_name} integers must be {self.bits}-bit g"
                             f"{self.group_size}, got {ints.bits}-bit g{ints.group_size}")
        n, pf = self.out_features, pack_factor(self.bits)
        self._set("qweight", pack_rows(ints.q.t(), self.bits))
        zeros = torch.full((self.num_groups, -(-n // pf) * pf), ints.zero, dtype=torch.int32)
        zeros[:, n:] = 0
        self._set("qzeros", pack_cols(zeros, self.bits))
        self._set("scales", ints.scales.t().to(torch.float32))
        if (ints.mins is None) != (self.mins is None):
            raise ValueError(f"{self.type_name} minimums must be "
                             f"{'present' if self.mins is not None else 'absent'}")
        if ints.mins is not None:
            self._set("mins", ints.mins.t().to(torch.float32))
        self._set("g_idx", torch.arange(self.in_features, dtype=torch.int32) // self.group_size)
        self.act_order = False
        self._prepare_cpu()

    def int_weight(self) -> IntWeight:
        return gptq_int_weight(self.qweight, self.qzeros, None, self.bits, self.group_size, 0,
                               False, self.mins)

    def _label(self) -> str:
        return f"GGUF {self.type_name} ({self.bits}-bit g{self.group_size}" \
               f"{' with minimums' if self.mins is not None else ''})"

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.gptq_gemm(x, self.qweight, self.qzeros, self.scales, None, self.bits,
                                   self.group_size, 0, False, None, mins=self.mins)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [T]`` of the weight, dequantized one by one: ``[T, K]`` in the module's
        dtype (a quantized token embedding looked up without dequantizing the table)."""
        flat = ids.reshape(-1).to(torch.int64)
        q = unpack_rows(self.qweight.index_select(1, flat), self.bits)       # [K, T]
        g = self.num_groups
        zero = unpack_rows_zero(self.qzeros, self.bits, flat)
        mins = None if self.mins is None else self.mins.index_select(1, flat)
        iw = IntWeight(q, zero.expand(g, flat.numel()), None, self.group_size, self.bits, mins)
        w = dequantize_int_weight(iw, self.scales.index_select(1, flat))    # [T, K]
        return w.to(self.dtype).reshape(*ids.shape, self.in_features)


def unpack_rows_zero(qzeros: torch.Tensor, bits: int, cols: torch.Tensor) -> torch.Tensor:
    """Zero points ``[G, T]`` of output columns ``cols`` from packed ``qzeros [G, N/pf]``."""
    pf = pack_factor(bits)
    words = qzeros.index_select(1, cols // pf)                              # [G, T]
    shift = ((cols % pf) * bits).to(torch.int32)
    return (words >> shift) & ((1 << bits) - 1)


class GGUFDensePart(nn.Module):
    """A float GGUF weight (F32/F16/BF16) inside a mixed fused projection: ``[N, K]`` in the
    model dtype."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype,
                                                   device=device))

    def load_weight(self, w: torch.Tensor) -> None:
        """Copy ``w [N, K]`` (float)."""
        self.weight.copy_(w.to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] -> [M, N]``."""
        return nn.functional.linear(x, self.weight.to(x.dtype))


class GGUFLinear(nn.Module):
    """A (fused) projection of GGUF weights: parts along the output features, then a bias.

    Args:
        parts: the part modules in output order (:class:`GGUFQuantLinear`,
            :class:`GGUFDensePart`). bias: the layer has a bias (float ``[N]``).
    """

    output_dims: ClassVar[dict[str, int | None]] = {}

    def __init__(self, in_features: int, parts: list[nn.Module], bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.parts = nn.ModuleList(parts)
        self.register_buffer("bias", torch.zeros(self.out_features, dtype=dtype, device=device)
                             if bias else None)

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Not used: the GGUF loader fills the parts (``load_ints``/``load_weight``).

        Raises:
            TypeError: always.
        """
        raise TypeError("GGUFLinear is loaded from a GGUF file by nybble.models.gguf_loader")

    def dequantized_weight(self) -> torch.Tensor:
        """``W [N, K]`` float (the parts' reference dequantizations concatenated)."""
        return torch.cat([p.weight if isinstance(p, GGUFDensePart) else p.dequantized_weight()
                          for p in self.parts], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if len(self.parts) == 1:
            y = self.parts[0](x2)
        else:
            y = torch.cat([p(x2) for p in self.parts], dim=-1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)
