"""Quantized linear modules. They satisfy the ``FusableLinear`` protocol that
``nybble.models.linear`` declares structurally: this package sits below the models and does
not import them.

Buffers carry exactly the checkpoint names and shapes (docs/quant-formats.md §3.1, §4.1, §6.2),
so the loader fuses q/k/v and gate/up by concatenating each tensor along ``output_dims[name]``
(§5.1). All modules take ``x [..., in]`` and return ``[..., out]`` in ``x.dtype``; the sum of
their buffer bytes is the real packed weight memory (:func:`weight_bytes`). ``group_size`` is
always the real, positive group size (the config resolves a per-channel ``-1``).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from nybble.kernels import quant_ops
from nybble.kernels.packing import pack_factor
from nybble.kernels.reference_quant import (
    default_g_idx,
    dequantize_awq,
    dequantize_compressed_tensors,
    dequantize_gptq,
    dequantize_int8_channel,
)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (packed ints, scales, biases)."""
    return sum(t.numel() * t.element_size()
               for t in list(module.parameters()) + list(module.buffers()))


class _QuantLinear(nn.Module):
    """Shared buffer handling; subclasses declare ``output_dims`` and ``_shapes()``."""

    output_dims: ClassVar[dict[str, int | None]] = {}
    optional: ClassVar[tuple[str, ...]] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.device_ = torch.device(device)
        self.register_buffer("bias", None)

    def _num_groups(self, group_size: int) -> int:
        """``ceil(in_features / group_size)``.

        Raises:
            ValueError: ``group_size`` not positive (a per-channel ``-1`` is resolved to
                ``in_features`` by :meth:`nybble.quant.config.LayerParams.group_size_for`).
        """
        if group_size <= 0:
            raise ValueError(f"group_size must be a positive number of input features, got "
                             f"{group_size}")
        return -(-self.in_features // group_size)

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def _set(self, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        shape = self._shapes()[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for a [{self.out_features}, "
                             f"{self.in_features}] {type(self).__name__}, got {tuple(t.shape)}")
        self.register_buffer(name, t.to(device=self.device_, dtype=dtype or t.dtype).contiguous())

    def _load_bias(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Keep ``bias [N]`` if the layer has one or the checkpoint's is nonzero (AutoGPTQ
        writes zero biases for bias-less layers, §3.1: those are dropped)."""
        b = tensors.get("bias")
        if b is None:
            if self.has_bias:
                raise ValueError(f"checkpoint lacks 'bias' for a {type(self).__name__} "
                                 f"[{self.out_features}, {self.in_features}] with bias")
            return
        if tuple(b.shape) != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(b.shape)}")
        if self.has_bias or bool(b.ne(0).any()):
            self.register_buffer("bias", b.to(device=self.device_, dtype=dtype))

    def _require(self, tensors: dict[str, torch.Tensor]) -> None:
        need = [n for n in self._shapes() if n not in self.optional and n not in tensors]
        if need:
            raise ValueError(f"checkpoint lacks {need} for a {type(self).__name__} "
                             f"[{self.out_features}, {self.in_features}]")

    def dequantized_weight(self) -> torch.Tensor:
        """``W [out, in]`` as the reference dequantization computes it."""
        raise NotImplementedError

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        return self._gemm(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)


class GPTQLinear(_QuantLinear):
    """GPTQ (v1 ``gptq`` / ``gptq_v2``) linear: ``qweight [K/pf, N]``, ``qzeros [G, N/pf]``,
    ``scales [G, N]``, ``g_idx [K]`` (§3). ``sym`` uses the fixed zero ``2^(bits-1)``."""

    output_dims: ClassVar[dict[str, int | None]] = {"qweight": 1, "qzeros": 1, "scales": 1,
                                                   "g_idx": None, "bias": 0}
    optional: ClassVar[tuple[str, ...]] = ("g_idx",)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, bits: int, group_size: int, zero_offset: int,
                 sym: bool) -> None:
        super().__init__(in_features, out_features, bias, device)
        self.bits, self.group_size = bits, group_size
        self.zero_offset, self.sym, self.dtype = zero_offset, sym, dtype
        self.pf = pack_factor(bits)
        self.num_groups = self._num_groups(group_size)
        self.act_order = False
        for name, shape in self._shapes().items():
            dt = torch.int32 if name != "scales" else torch.float16
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=self.device_))

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        k, n, g, pf = self.in_features, self.out_features, self.num_groups, self.pf
        return {"qweight": (k // pf, n), "qzeros": (g, -(-n // pf)), "scales": (g, n),
                "g_idx": (k,)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take ``qweight``, ``qzeros``, ``scales`` (kept in their checkpoint dtype), optional
        ``g_idx`` and ``bias``.

        Raises:
            ValueError: missing tensor or wrong shape.
        """
        self._require(tensors)
        for name in ("qweight", "qzeros", "scales"):
            self._set(name, tensors[name])
        trivial = default_g_idx(self.in_features, self.group_size).to(torch.int32)
        g = tensors.get("g_idx")
        self._set("g_idx", trivial if g is None else g, torch.int32)
        self.act_order = not torch.equal(self.g_idx.cpu(), trivial)
        self._load_bias(tensors, self.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_gptq(self.qweight, self.qzeros, self.scales,
                               self.g_idx if self.act_order else None, self.bits,
                               self.group_size, self.zero_offset, self.sym)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.gptq_gemm(x, self.qweight, self.qzeros, self.scales,
                                   self.g_idx if self.act_order else None, self.bits,
                                   self.group_size, self.zero_offset, self.sym, self.bias)


class AWQLinear(_QuantLinear):
    """AutoAWQ GEMM 4-bit linear: ``qweight [K, N/8]``, ``qzeros [G, N/8]``, ``scales [G, N]``
    (§4)."""

    output_dims: ClassVar[dict[str, int | None]] = {"qweight": 1, "qzeros": 1, "scales": 1,
                                                   "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, group_size: int) -> None:
        super().__init__(in_features, out_features, bias, device)
        self.group_size, self.dtype = group_size, dtype
        self.num_groups = self._num_groups(group_size)
        for name, shape in self._shapes().items():
            dt = torch.int32 if name != "scales" else torch.float16
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=self.device_))

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        k, n, g = self.in_features, self.out_features, self.num_groups
        return {"qweight": (k, n // 8), "qzeros": (g, n // 8), "scales": (g, n)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take ``qweight``, ``qzeros``, ``scales`` and an optional ``bias``.

        Raises:
            ValueError: missing tensor or wrong shape.
        """
        self._require(tensors)
        for name in ("qweight", "qzeros", "scales"):
            self._set(name, tensors[name])
        self._load_bias(tensors, self.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.awq_gemm(x, self.qweight, self.qzeros, self.scales, self.group_size,
                                  self.bias)


class CompressedPackedLinear(_QuantLinear):
    """compressed-tensors ``pack-quantized`` (W4A16 / W8A16) linear: ``weight_packed [N, K/pf]``,
    ``weight_scale [N, G]``, ``weight_shape`` (per shard ``[N_s, K]``), optional
    ``weight_zero_point [N/pf, G]`` and ``weight_g_idx [K]`` (§6.2)."""

    output_dims: ClassVar[dict[str, int | None]] = {
        "weight_packed": 0, "weight_scale": 0, "weight_zero_point": 0, "weight_shape": 0,
        "weight_g_idx": None, "bias": 0}
    optional: ClassVar[tuple[str, ...]] = ("weight_zero_point", "weight_g_idx")

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, bits: int, group_size: int, sym: bool) -> None:
        super().__init__(in_features, out_features, bias, device)
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

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_compressed_tensors(self.weight_packed, self.weight_scale,
                                             self.weight_zero_point, self.weight_g_idx,
                                             self.bits, self.group_size)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.dequantized_weight().to(x.dtype).t()
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Int8W8A8Linear(_QuantLinear):
    """compressed-tensors ``int-quantized`` W8A8: int8 ``weight [N, K]``, ``weight_scale [N, 1]``,
    activations quantized per token at run time (§6.2)."""

    output_dims: ClassVar[dict[str, int | None]] = {"weight": 0, "weight_scale": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(in_features, out_features, bias, device)
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

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8_channel(self.weight, self.weight_scale)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.w8a8_gemm(x, self.weight, self.weight_scale, self.bias)
