"""Attention backend selection: :func:`get_attention_backend` picks the torch reference, the CPU
decode kernel (:mod:`nybble.kernels.cpu.backend`) or the Triton kernels once, when the engine
starts. Quantized GEMMs are dispatched per call instead,
by the device of the activations, in :mod:`nybble.kernels.quant_ops`; the bit-packing layout
both the kernels and the checkpoint formats read is :mod:`nybble.kernels.packing`."""
from __future__ import annotations

import torch

from nybble.kernels.cpu.backend import CpuAttentionBackend, cpu_kernel_available
from nybble.kernels.interface import AttentionBackend, AttentionMetadata
from nybble.kernels.reference.attention import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick the attention backend.

    Args:
        name: ``auto`` (Triton on CUDA, else ``cpu`` when its kernel is built, else
            ``torch``), ``cpu`` (the Cython decode kernel + the torch reference), ``torch``
            (the pure-torch reference) or ``triton``.
        device: where the KV cache lives.

    Raises:
        ValueError: unknown name, ``cpu`` off the CPU, or ``triton`` requested where Triton
            cannot run (no CUDA device and ``TRITON_INTERPRET`` unset, or triton not
            installed).
        RuntimeError: ``cpu`` requested but its kernel extension is not built.
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if cpu_kernel_available() else \
            "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' needs device 'cpu', got {device.type!r}")
        return CpuAttentionBackend()
    if name == "triton":
        import os

        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' needs a CUDA device or "
                             f"TRITON_INTERPRET=1, got device {device.type!r}")
        try:
            from nybble.kernels.triton.backend import TritonAttentionBackend
        except ImportError as e:
            raise ValueError(f"attention_backend 'triton' needs the triton package: {e}") from e
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be one of auto, cpu, torch, triton, got {name!r}")
