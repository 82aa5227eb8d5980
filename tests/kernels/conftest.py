"""Kernel tests run Triton natively on CUDA, else on CPU through the Triton interpreter.

``TRITON_INTERPRET`` is read when triton is first imported, so it is set here, before any test
module imports a ``nybble.kernels.triton.*`` module.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# one GEMM config per path: autotuning every layout variant would only add compile time
os.environ.setdefault("NYBBLE_TRITON_AUTOTUNE", "0")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels under test run (CUDA if present, else CPU via the interpreter)."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

