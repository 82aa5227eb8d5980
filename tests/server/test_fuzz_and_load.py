"""Short versions of ``benchmarks/api_fuzz.py`` and ``benchmarks/serve_stress.py`` on the
session server: schemathesis finds no 5xx, dropped connection or schema violation and the
greedy text is unchanged after; abandoned streams leave the server idle and every other
stream whole; a burst is answered completely."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from nybble.bench.serve_fuzz import fuzz
from nybble.bench.serve_stress import burst, disconnect_round, server_state

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server, pytest.mark.slow]

GREEDY = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.0}


def _greedy(server: Server) -> str:
    with server.http() as c:
        return str(c.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"])


def _assert_idle(server: Server) -> None:
    server.wait_idle()
    state = server_state(server.url, api_key=server.api_key)
    assert state["used_kv_blocks"] == 0
    assert state["gauge_running"] == 0 and state["gauge_waiting"] == 0


def test_short_api_fuzz(server: Server) -> None:
    before = _greedy(server)
    result = fuzz(server.url, examples=25, api_key=server.api_key, workers=4, seed=1)
    figures = result.as_dict()
    assert figures["requests"] > 200 and len(figures["by_operation"]) == 11
    assert figures["server_errors"] == 0, figures["examples"]
    assert figures["dropped_connections"] == 0, figures["dropped"]
    assert figures["schema_violations"] == 0, figures["examples"]
    assert {"200", "400", "401"} <= set(figures["by_status"])
    _assert_idle(server)
    assert _greedy(server) == before


def test_short_disconnect_round(server: Server) -> None:
    result = asyncio.run(disconnect_round(server.url, num_requests=60, concurrency=20,
                                          disconnect_fraction=0.3, max_tokens=(4, 40),
                                          seed=3, api_key=server.api_key))
    assert result.errors == [] and result.wrong == []
    assert result.left_before_answer + result.left_mid_stream > 5
    assert result.completed_exactly == result.stayed > 30
    _assert_idle(server)


def test_short_burst(server: Server) -> None:
    figures = asyncio.run(burst(server.url, num_requests=150, max_tokens=8,
                                api_key=server.api_key))
    assert figures["num_errors"] == 0, figures["errors"]
    assert figures["statuses"] == {"200": 150} and figures["200_with_wrong_tokens"] == 0
    _assert_idle(server)
