"""compressed-tensors (LLM Compressor) linear modules: ``pack-quantized`` W4A16/W8A16 and
``int-quantized`` W8A8 (docs/quant-formats.md §6.2). Same contract as
:mod:`nybble.quant.linear`.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from nybble.kernels import quant_ops
from nybble.kernels.packing import pack_factor
from nybble.kernels.reference.quant import (
    IntWeight,
    compressed_int_weight,
    dequantize_int8_channel,
)
from nybble.quant.linear import CpuPathLog, QuantLinear


class CompressedPackedLinear(QuantLinear):
    """compressed-tensors ``pack-quantized`` (W4A16 / W8A16) linear: ``weight_packed [N, K/pf]``,
    ``weight_scale [N, G]``, ``weight_shape`` (per shard ``[N_s, K]``), optional
    ``weight_zero_point [N/pf, G]`` and ``weight_g_idx [K]`` (§6.2)."""

    output_dims: ClassVar[dict[str, int | None]] = {
        "weight_packed": 0, "weight_scale": 0, "weight_zero_point": 0, "weight_shape": 0,
        "weight_g_idx": None, "bias": 0}
    input_dims: ClassVar[dict[str, int | None]] = {
        "weight_packed": 1, "weight_scale": 1, "weight_zero_point": 1, "weight_g_idx": 0,
        "bias": None}
    group_tensors: ClassVar[tuple[str, ...]] = ("weight_scale", "weight_zero_point")
    optional: ClassVar[tuple[str, ...]] = ("weight_zero_point", "weight_g_idx")

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, bits: int, group_size: int, sym: bool,
                 path_log: CpuPathLog | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, path_log)
        self.bits, self.group_size, self.sym, self.dtype = bits, group_size, sym, dtype
        self.pf = pack_factor(bits)
        self.num_groups = self._num_groups(group_size)
        self.register_buffer("weight_packed", torch.zeros(self._shapes()["weight_packed"],
                                                          dtype=torch.int32, device=self.device_))
        self.register_buffer("weight_scale", torch.zeros(self._shapes()["weight_scale"],
                                                         dtype=torch.float16, device=self.device_))
        self.register_buffer("weight_zero_point", None)
        self.register_buffer("weight_g_idx", None)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        k, n, g, pf = self.in_features, self.out_features, self.num_groups, self.pf
        return {"weight_packed": (n, k // pf), "weight_scale": (n, g),
                "weight_zero_point": (-(-n // pf), g), "weight_g_idx": (k,)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the compressed-tensors tensors; ``weight_shape`` (fused: ``[N_1, K, N_2, K, ...]``)
        must sum to this layer's shape.

        Raises:
            ValueError: missing tensor, wrong shape, or a zero point on a symmetric scheme.
        """
        self._require(tensors)
        ws = tensors.get("weight_shape")
        if ws is not None:
            pairs = ws.reshape(-1, 2).tolist()
            if sum(p[0] for p in pairs) != self.out_features or any(
                    p[1] != self.in_features for p in pairs):
                raise ValueError(f"weight_shape must describe [{self.out_features}, "
                                 f"{self.in_features}], got {pairs}")
        self._set("weight_packed", tensors["weight_packed"])
        self._set("weight_scale", tensors["weight_scale"])
        if "weight_zero_point" in tensors:
            if self.sym:
                raise ValueError("weight_zero_point must be absent for a symmetric scheme, "
                                 "got a tensor")
            self._set("weight_zero_point", tensors["weight_zero_point"], torch.int32)
        if "weight_g_idx" in tensors:
            self._set("weight_g_idx", tensors["weight_g_idx"], torch.int32)
        self._load_bias(tensors, self.dtype)
        self._prepare_cpu()

    def int_weight(self) -> IntWeight:
        return compressed_int_weight(self.weight_packed, self.weight_zero_point,
                                     self.weight_g_idx, self.bits, self.group_size,
                                     self.num_groups)

    def weight_scales(self) -> torch.Tensor:
        return self.weight_scale.t()

    def _label(self) -> str:
        return f"compressed-tensors W{self.bits}A16 {'sym' if self.sym else 'asym'}"

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.dequantized_weight().to(x.dtype).t()
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Int8W8A8Linear(QuantLinear):
    """compressed-tensors ``int-quantized`` W8A8: int8 ``weight [N, K]``, ``weight_scale [N, 1]``,
    activations quantized per token at run time (§6.2)."""

    output_dims: ClassVar[dict[str, int | None]] = {"weight": 0, "weight_scale": 0, "bias": 0}
    input_dims: ClassVar[dict[str, int | None]] = {"weight": 1, "weight_scale": None,
                                                  "bias": None}

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, path_log: CpuPathLog | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, path_log)
        self.dtype = dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                   device=self.device_))
        self.register_buffer("weight_scale", torch.zeros(out_features, 1, dtype=torch.float16,
                                                         device=self.device_))

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.out_features, self.in_features),
                "weight_scale": (self.out_features, 1)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take int8 ``weight`` and ``weight_scale`` (and an optional ``bias``).

        Raises:
            ValueError: missing tensor, wrong shape or a non-int8 weight.
        """
        self._require(tensors)
        if tensors["weight"].dtype != torch.int8:
            raise ValueError(f"weight must be int8, got {tensors['weight'].dtype}")
        self._set("weight", tensors["weight"])
        self._set("weight_scale", tensors["weight_scale"])
        self._load_bias(tensors, self.dtype)
        self._prepare_cpu()

    def _label(self) -> str:
        return "compressed-tensors W8A8"

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8_channel(self.weight, self.weight_scale)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.w8a8_gemm(x, self.weight, self.weight_scale, self.bias)
