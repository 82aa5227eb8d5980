"""The ``ray`` executor: a local Ray cluster on loopback started by the engine (no
``RAY_ADDRESS``); its workers are Ray actors, and greedy tokens equal the ``mp`` executor's."""
from __future__ import annotations

import pytest
import ray   # the test extra installs it (pip install -e ".[test]")

from nybble.config import DEFAULT_MODEL
from tests.distributed.test_tp_generate import greedy_tokens


@pytest.mark.slow
def test_ray_executor_gives_the_same_tokens_as_mp(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")     # a throwaway local cluster
    mp = greedy_tokens(DEFAULT_MODEL, 2, distributed_executor_backend="mp")
    got = greedy_tokens(DEFAULT_MODEL, 2, distributed_executor_backend="ray")
    assert got == mp
    assert not ray.is_initialized()     # the cluster the engine started is shut down
