"""The pytest markers are registered (``--strict-markers``) and ``gpu`` tests skip without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import pytest_collection_modifyitems


class _Item:
    """The part of ``pytest.Item`` the collection hook uses."""

    def __init__(self, *markers: str) -> None:
        self.marks = [getattr(pytest.mark, name).mark for name in markers]

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.marks.append(marker.mark)


def test_markers_are_registered_and_strict(pytestconfig: pytest.Config) -> None:
    names = {line.split(":", 1)[0].strip() for line in pytestconfig.getini("markers")}
    assert {"slow", "server", "triton_interpret", "gpu"} <= names
    assert "--strict-markers" in pytestconfig.getini("addopts")


@pytest.mark.parametrize("cuda", [False, True])
def test_gpu_tests_are_skipped_without_cuda(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    gpu, other = _Item("gpu"), _Item("slow")
    pytest_collection_modifyitems(None, [gpu, other])  # type: ignore[arg-type,list-item]
    skips = [m for m in gpu.marks if m.name == "skip"]
    assert len(skips) == (0 if cuda else 1)
    assert all("CUDA" in m.kwargs["reason"] for m in skips)
    assert [m.name for m in other.marks] == ["slow"]
