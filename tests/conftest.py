"""Shared fixtures: the bundled model, tiny random HF models, offline mode."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NOTE: one intra-op thread. The models under test are tiny, and on a 2-core machine shared
# with a server subprocess, OpenMP spin-waiting makes 2 threads ~50x slower than 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from nybble.config import DEFAULT_MODEL

SHARED = os.environ.get("NYBBLE_SHARED") or os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
"""The project's shared data folder (a sibling of the checkout, as CI lays it out)."""


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
