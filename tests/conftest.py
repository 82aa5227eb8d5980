"""Shared fixtures: the bundled model, tiny random HF models, offline mode."""
from __future__ import annotations

import glob
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NOTE: one intra-op thread. The models under test are tiny, and on a 2-core machine shared
# with a server subprocess, OpenMP spin-waiting makes 2 threads ~50x slower than 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# TRITON_INTERPRET is read when triton is first imported, and test modules outside
# tests/kernels can import it first (transformers' mixture-of-experts models do): without
# CUDA the whole run uses the interpreter (tests/kernels/conftest.py's rule, set here first;
# no torch import needed: the NVIDIA driver's device file tells)
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from nybble.config import DEFAULT_MODEL

SHARED = os.environ.get("NYBBLE_SHARED") or os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
"""The project's shared data folder (a sibling of the checkout, as CI lays it out). Tests
reach it only through :func:`shared_path` and :func:`shared_folders`, which skip them with
the reason when it is absent."""


def _missing(path: str) -> str:
    return (f"needs the shared data folder: {path} is missing (set NYBBLE_SHARED to the "
            f"shared/ folder, or place it next to the checkout)")


def shared_path(*parts: str) -> str:
    """The path of ``parts`` under the shared data folder.

    When it does not exist, skips with the reason: the whole module when called at module
    level (instead of crashing collection), else the calling test or fixture.
    """
    path = os.path.join(SHARED, *parts)
    if not os.path.exists(path):
        pytest.skip(_missing(path), allow_module_level=True)
    return path


def shared_folders(*patterns: str) -> list[Any]:
    """Sorted folders under the shared data folder matching the glob ``patterns``, as
    ``parametrize`` values; without the shared folder, one skipped case that says why (the
    cases are not silently dropped)."""
    if not os.path.isdir(SHARED):
        return [pytest.param(os.path.join(SHARED, patterns[0]), id="shared-data-missing",
                             marks=pytest.mark.skip(reason=_missing(SHARED)))]
    return sorted(d for p in patterns for d in glob.glob(os.path.join(SHARED, p)))


@pytest.fixture(scope="session")
def bundled_model() -> str:
    """Path of the bundled stories260k model folder."""
    return DEFAULT_MODEL


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when torch sees no CUDA device (markers: pyproject.toml)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is false")
    for item in gpu_items:
        item.add_marker(skip)
