"""API key: 401 without or with a wrong key on /v1 routes, 200 with the right one."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from nybble.server import cli
from nybble.server.config import ServerConfig

if TYPE_CHECKING:
    from tests.server.conftest import Server


@pytest.mark.server
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"},
                                     {"Authorization": "nybble-test-key"}],
                         ids=["missing", "wrong", "no-bearer"])
def test_missing_or_wrong_key_is_401(server: Server, headers: dict[str, str]) -> None:
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                               ("POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}]})]:
        r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.server
def test_right_key_is_200(server: Server) -> None:
    with server.http() as c:
        assert c.get("/v1/models").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code \
            == 200


@pytest.mark.server
def test_openai_client_with_wrong_key(server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert server.openai().models.list().data


@pytest.mark.server
def test_probes_need_no_key(server: Server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/version", timeout=30).json()["version"]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_api_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NYBBLE_API_KEY", raising=False)
    assert ServerConfig.from_args(parse_serve([])).api_key is None
    monkeypatch.setenv("NYBBLE_API_KEY", "from-env")
    assert ServerConfig.from_args(parse_serve([])).api_key == "from-env"
    assert ServerConfig.from_args(parse_serve(["--api-key", "flag"])).api_key == "flag"
    args = parse_serve(["some/model", "--port", "9001", "--served-model-name", "m"])
    config = ServerConfig.from_args(args)
    assert (config.port, config.served_model_names, args.model_tag) == (9001, ("m",), "some/model")
