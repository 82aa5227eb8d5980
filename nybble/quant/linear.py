"""Quantized linear modules. They satisfy the ``FusableLinear`` protocol that
``nybble.models.linear`` declares structurally: this package sits below the models and does
not import them.

Buffers carry exactly the checkpoint names and shapes (docs/quant-formats.md §3.1, §4.1, §6.2),
so the loader fuses q/k/v and gate/up by concatenating each tensor along ``output_dims[name]``
(§5.1). All modules take ``x [..., in]`` and return ``[..., out]`` in ``x.dtype``; the sum of
their buffer bytes is the checkpoint's packed weight memory (:func:`weight_bytes`).
``group_size`` is always the real, positive group size (the config resolves a per-channel
``-1``).

CPU: a module loaded on the CPU also repacks its weight once for one of nybble's CPU kernels,
chosen by the model's ``cpu_activation_dtype`` (:class:`CpuPathLog` carries it):

* ``int16`` (the default where the CPU has AVX-512 VNNI) and ``int8``: the integer-dot
  kernel (``idot.h``, packed by :mod:`nybble.kernels.cpu.qgemm_pack`): activations quantized
  per block of 32 inputs to 15 or 8 bits, exact int32 dot products, for calls of any number
  of rows;
* ``bfloat16`` (the default where the CPU has AVX-512 BF16 but no VNNI): the bf16-dot kernel
  (:mod:`nybble.kernels.cpu.qgemm_pack`; 0.5 / 1 byte per weight plus float16 scales) for
  calls of any number of rows, decode and prefill;
* calls of at least ``CpuPathLog.prefill_rows`` rows on a packed weight (prefill chunks;
  by default where the CPU has AMX-BF16, or runs the integer-dot kernel's AVX2 loop): the
  weight dequantized once per call to bfloat16 (AMX) or float32 (AVX2) and one torch GEMM
  (:func:`~nybble.kernels.cpu.qgemm_pack.prefill_linear`);
* ``float32`` (exact): the float32 weight-only kernel (:mod:`nybble.kernels.cpu.weight_only`)
  for calls of up to ``KERNEL_ROWS`` tokens, the reference dequantization beyond.

Float64 calls (the test oracle) and layouts a kernel cannot take use the reference
dequantization. Each distinct choice is logged once per model. ``NYBBLE_CPU_WEIGHT_ONLY=0``
turns the repack off.
"""
from __future__ import annotations

import logging
import os
from typing import ClassVar

import torch
from torch import nn

from nybble.kernels import quant_ops
from nybble.kernels.cpu import qgemm_pack as cpu_qgemm_pack
from nybble.kernels.cpu import weight_only as cpu_weight_only
from nybble.kernels.packing import pack_factor
from nybble.kernels.reference.quant import (
    IntWeight,
    awq_int_weight,
    default_g_idx,
    dequantize_int_weight,
    gptq_int_weight,
)

logger = logging.getLogger(__name__)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` (packed ints, scales, biases)."""
    return sum(t.numel() * t.element_size()
               for t in list(module.parameters()) + list(module.buffers()))


class CpuPathLog:
    """A model's CPU matmul policy for its quantized layers, and the log of what each chose.

    One instance per model: :class:`nybble.quant.config.QuantConfig` owns one and hands it to
    every module it builds; modules built without one share a process-wide instance.

    Attributes:
        activations: ``int16`` / ``int8`` (the integer-dot kernel), ``bfloat16`` (the bf16-dot
            kernel) or ``float32`` (the exact path); set
            by the loader from ``ModelConfig.cpu_activation_dtype`` before the weights load.
        prefill_rows: calls of at least this many rows on a packed weight take
            :func:`~nybble.kernels.cpu.qgemm_pack.prefill_linear` (dequantize once + one
            GEMM); None: never. prefill_dtype: that GEMM's ``bfloat16`` or ``float32``. Set
            by the loader from ``ModelConfig.cpu_prefill_gemm``.
    """

    def __init__(self, activations: str = "float32", prefill_rows: int | None = None,
                 prefill_dtype: str = "bfloat16") -> None:
        self._seen: set[tuple[str, str]] = set()
        self.activations = activations
        self.prefill_rows = prefill_rows
        self.prefill_dtype = prefill_dtype

    def note(self, layer: str, choice: str) -> None:
        """Log ``"<layer>: CPU matmul <choice>"`` the first time this pair is seen."""
        if (layer, choice) not in self._seen:
            self._seen.add((layer, choice))
            logger.info("%s: CPU matmul %s", layer, choice)


_SHARED_LOG = CpuPathLog()


def cpu_kernels_enabled() -> bool:
    """False when ``NYBBLE_CPU_WEIGHT_ONLY=0`` (keep the reference path on CPU)."""
    return os.environ.get("NYBBLE_CPU_WEIGHT_ONLY", "1") != "0"


class QuantLinear(nn.Module):
    """Shared buffer handling; subclasses declare ``output_dims`` and ``_shapes()``."""

    output_dims: ClassVar[dict[str, int | None]] = {}
    input_dims: ClassVar[dict[str, int | None]] = {}
    group_tensors: ClassVar[tuple[str, ...]] = ()
    optional: ClassVar[tuple[str, ...]] = ()
    num_groups: int = 1

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 device: torch.device, path_log: CpuPathLog | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.device_ = torch.device(device)
        self.register_buffer("bias", None)
        self.path_log = path_log or _SHARED_LOG
        self.cpu_weight: cpu_weight_only.CpuWeight | None = None
        self.cpu_packed: cpu_qgemm_pack.QPacked | None = None

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

    def keep_all_groups(self, num_groups: int) -> None:
        """Before :meth:`load_tensors`: this module is a row-parallel shard of an act-order
        layer (tensor parallelism), whose ``g_idx`` points into all ``num_groups`` groups of
        the whole layer, so its group tensors keep every group."""
        self.num_groups = num_groups

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

    def int_weight(self) -> IntWeight | None:
        """The weight's integers (None: not a weight-only integer format)."""
        return None

    def weight_scales(self) -> torch.Tensor:
        """Scales ``[G, N]`` matching :meth:`int_weight`."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """``W [out, in]`` as the reference dequantization computes it."""
        iw = self.int_weight()
        assert iw is not None
        return dequantize_int_weight(iw, self.weight_scales())

    def _label(self) -> str:
        return type(self).__name__

    def _prepare_cpu(self) -> None:
        """After loading: repack for the CPU kernels when the module lives on the CPU."""
        self.cpu_weight = self.cpu_packed = None
        if self.device_.type != "cpu":
            return
        iw = self.int_weight()
        if iw is None:
            choice = "reference (activations are quantized too; no weight-only kernel)"
        elif not cpu_kernels_enabled():
            choice = "reference (NYBBLE_CPU_WEIGHT_ONLY=0)"
        elif self.path_log.activations in cpu_qgemm_pack.ACTIVATION_PLANES and (
                packed := cpu_qgemm_pack.pack(iw, self.weight_scales(),
                                              activations=self.path_log.activations)
                )[0] is not None:
            self.cpu_packed, choice = packed
        else:
            self.cpu_weight, why = cpu_weight_only.prepare(iw, self.weight_scales())
            choice = (f"{why} up to {cpu_weight_only.KERNEL_ROWS} tokens, reference beyond"
                      if self.cpu_weight is not None else f"reference ({why})")
        self.path_log.note(self._label(), choice)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in ``x.dtype``."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.cpu_packed is not None and x2.device.type == "cpu" and x2.dtype != torch.float64:
            rows = self.path_log.prefill_rows
            if rows is not None and x2.shape[0] >= rows:
                y = cpu_qgemm_pack.prefill_linear(x2, self.cpu_packed, self.bias,
                                                  self.path_log.prefill_dtype)
            else:
                y = cpu_qgemm_pack.linear(x2, self.cpu_packed, self.bias)
        elif (self.cpu_weight is not None and x2.device.type == "cpu"
                and x2.shape[0] <= cpu_weight_only.KERNEL_ROWS and x2.dtype != torch.float64):
            y = cpu_weight_only.linear(x2, self.cpu_weight, self.bias)
        else:
            y = self._gemm(x2)
        return y.reshape(*lead, self.out_features)


class GPTQLinear(QuantLinear):
    """GPTQ (v1 ``gptq`` / ``gptq_v2``) linear: ``qweight [K/pf, N]``, ``qzeros [G, N/pf]``,
    ``scales [G, N]``, ``g_idx [K]`` (§3). ``sym`` uses the fixed zero ``2^(bits-1)``."""

    output_dims: ClassVar[dict[str, int | None]] = {"qweight": 1, "qzeros": 1, "scales": 1,
                                                   "g_idx": None, "bias": 0}
    input_dims: ClassVar[dict[str, int | None]] = {"qweight": 0, "qzeros": 0, "scales": 0,
                                                  "g_idx": 0, "bias": None}
    group_tensors: ClassVar[tuple[str, ...]] = ("qzeros", "scales")
    optional: ClassVar[tuple[str, ...]] = ("g_idx",)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, bits: int, group_size: int, zero_offset: int,
                 sym: bool, path_log: CpuPathLog | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, path_log)
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
        self._prepare_cpu()

    def int_weight(self) -> IntWeight:
        return gptq_int_weight(self.qweight, self.qzeros, self.g_idx if self.act_order else None,
                               self.bits, self.group_size, self.zero_offset, self.sym)

    def weight_scales(self) -> torch.Tensor:
        return self.scales

    def _label(self) -> str:
        return (f"GPTQ {self.bits}-bit {'sym' if self.sym else 'asym'}"
                f"{' act-order' if self.act_order else ''}")

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.gptq_gemm(x, self.qweight, self.qzeros, self.scales,
                                   self.g_idx if self.act_order else None, self.bits,
                                   self.group_size, self.zero_offset, self.sym, self.bias)


class AWQLinear(QuantLinear):
    """AutoAWQ GEMM 4-bit linear: ``qweight [K, N/8]``, ``qzeros [G, N/8]``, ``scales [G, N]``
    (§4)."""

    output_dims: ClassVar[dict[str, int | None]] = {"qweight": 1, "qzeros": 1, "scales": 1,
                                                   "bias": 0}
    input_dims: ClassVar[dict[str, int | None]] = {"qweight": 0, "qzeros": 0, "scales": 0,
                                                  "bias": None}
    group_tensors: ClassVar[tuple[str, ...]] = ("qzeros", "scales")

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, group_size: int,
                 path_log: CpuPathLog | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, path_log)
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
        self._prepare_cpu()

    def int_weight(self) -> IntWeight:
        return awq_int_weight(self.qweight, self.qzeros, self.group_size)

    def weight_scales(self) -> torch.Tensor:
        return self.scales

    def _label(self) -> str:
        return "AWQ 4-bit"

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return quant_ops.awq_gemm(x, self.qweight, self.qzeros, self.scales, self.group_size,
                                  self.bias)
