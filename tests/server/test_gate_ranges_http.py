"""The issue's wedge reproducers over HTTP: an out-of-range seed or top_k is a 400 naming the
parameter, the extreme seeds in range work with several samples (derived seeds wrap instead
of overflowing), ``seed: -1`` means no seed, and the server answers normally afterwards."""
from __future__ import annotations

import pytest

from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

BODY = {"model": "stories260k", "prompt": "The dog", "max_tokens": 6}


@pytest.mark.parametrize("extra,param", [
    ({"temperature": 0.8, "seed": 18446744073709551616}, "seed"),
    ({"temperature": 0.8, "seed": -9223372036854775809}, "seed"),
    ({"temperature": 0.0, "top_k": 9223372036854775808}, "top_k"),
    ({"logprobs": 513}, "logprobs"),
])
def test_out_of_range_is_a_400_naming_the_parameter(server: Server, extra: dict,
                                                    param: str) -> None:
    with server.http() as c:
        r = c.post("/v1/completions", json={**BODY, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        ok = c.post("/v1/completions", json={**BODY, "temperature": 0.0})
        assert ok.status_code == 200


@pytest.mark.parametrize("seed", [18446744073709551615, -9223372036854775808, -1])
def test_extreme_seeds_with_two_samples(server: Server, seed: int) -> None:
    with server.http() as c:
        body = {**BODY, "temperature": 0.8, "n": 2, "seed": seed}
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert len(first.json()["choices"]) == 2
        if seed != -1:   # seeded: reproducible
            again = c.post("/v1/completions", json=body).json()["choices"]
            assert [ch["text"] for ch in again] == [ch["text"] for ch in first.json()["choices"]]
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_blocks"]
