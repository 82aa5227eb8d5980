"""``--threads``: the default rule, its priority order, and the OpenMP environment it sets."""
from __future__ import annotations

import os

import pytest

from nybble import threads
from nybble.threads import default_threads, resolve_threads, set_thread_env


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 1), (3, 2), (4, 3), (16, 15)])
def test_default_leaves_a_core_for_the_http_side_above_two(cores: int, want: int) -> None:
    assert default_threads(cores) == want


def test_flag_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "physical_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert resolve_threads(None) == (7, "default for 8 physical cores")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resolve_threads(None) == (3, "OMP_NUM_THREADS")
    assert resolve_threads(5) == (5, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be an integer >= 1, got 'lots'"):
        resolve_threads(None)
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        resolve_threads(0)


def test_environment_for_openmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    set_thread_env(2)
    assert os.environ["OMP_NUM_THREADS"] == "2"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")   # a user's explicit choice is kept
    set_thread_env(2)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_physical_cores_counts_allowed_cores() -> None:
    n = threads.physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0))
