"""``nybble serve --enable-lora``: adapters picked by ``model``, listed by ``/v1/models`` with
their parent, loaded and unloaded at run time while another request runs, every bad adapter a
clear 400 while the server goes on, and the per-adapter metrics. The adapters are saved by
PEFT in the test; their outputs are checked against transformers + PEFT."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nybble.config import DEFAULT_MODEL
from tests.conftest import shared_path
from tests.lora.adapters import PeftOracle, make_adapter
from tests.server.conftest import start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]
PROMPT = [1, 403, 407, 261, 378, 442]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("lora")
    folders = {
        "a": make_adapter(DEFAULT_MODEL, str(root / "a"), r=8, alpha=16, seed=1),
        "b": make_adapter(DEFAULT_MODEL, str(root / "b"), r=16, alpha=8, seed=2,
                          use_rslora=True),
        "c": make_adapter(DEFAULT_MODEL, str(root / "c"), r=4, alpha=4, seed=3,
                          targets=("q_proj", "v_proj")),
        "dora": make_adapter(DEFAULT_MODEL, str(root / "dora"), r=4, alpha=8, seed=4,
                             use_dora=True),
        "saves": make_adapter(DEFAULT_MODEL, str(root / "saves"), r=4, alpha=8, seed=5,
                              modules_to_save=["lm_head"]),
        "embed": make_adapter(DEFAULT_MODEL, str(root / "embed"), r=4, alpha=8, seed=6,
                              targets=("embed_tokens", "q_proj")),
        "rank32": make_adapter(DEFAULT_MODEL, str(root / "rank32"), r=32, alpha=8, seed=7),
        "other_base": make_adapter(shared_path("models", "stories3m"), str(root / "3m"),
                                   r=4, alpha=8, seed=8),
    }
    proc, url = start_server(
        root / "serve.log", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"a={folders['a']}",
        json.dumps({"name": "b", "path": folders["b"], "base_model_name": "stories260k"}),
        "--allow-runtime-lora-updating", "--stats-interval", "1")
    try:
        yield {"url": url, "folders": folders}
    finally:
        stop_server(proc)


def _complete(url: str, model: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})


def _expected_text(url: str, folder: str | None, steps: int = 8) -> str:
    tokens, _ = PeftOracle(DEFAULT_MODEL, folder).greedy(PROMPT, steps)
    full = httpx.post(f"{url}/detokenize", json={"tokens": PROMPT + tokens}).json()["prompt"]
    head = httpx.post(f"{url}/detokenize", json={"tokens": PROMPT}).json()["prompt"]
    assert full.startswith(head)
    return full[len(head):]


def test_a_request_picks_its_adapter_by_model(lora_server) -> None:
    url, folders = lora_server["url"], lora_server["folders"]
    texts = {}
    for model, folder in (("stories260k", None), ("a", folders["a"]), ("b", folders["b"])):
        r = _complete(url, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
        assert texts[model] == _expected_text(url, folder), model
    assert len(set(texts.values())) == 3
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "b"


def test_models_lists_the_adapters_with_their_parent(lora_server) -> None:
    url, folders = lora_server["url"], lora_server["folders"]
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models").json()["data"]}
    assert {"stories260k", "a", "b"} <= set(cards)
    assert cards["stories260k"]["parent"] is None
    assert cards["a"]["parent"] == "stories260k"
    assert cards["a"]["root"] == "a" and folders["a"].endswith("/a")   # the name, not the path
    assert httpx.get(f"{url}/v1/models/b").json()["parent"] == "stories260k"


def test_unknown_model_is_a_404(lora_server) -> None:
    r = _complete(lora_server["url"], "nope")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "model" and "`a`" in error["message"]


@pytest.mark.parametrize("adapter,message", [
    ("dora", "DoRA"), ("saves", "modules_to_save"), ("embed", "embeddings or the LM head"),
    ("rank32", "above max_lora_rank 16"), ("other_base", "another base model"),
    ("missing", "no such folder")])
def test_each_bad_adapter_is_a_400_and_the_server_goes_on(lora_server, adapter: str,
                                                          message: str) -> None:
    url = lora_server["url"]
    path = lora_server["folders"].get(adapter, "/nonexistent/adapter")
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": f"bad-{adapter}",
                                                         "lora_path": path})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "lora_path"
    assert message in error["message"]
    assert _complete(url, f"bad-{adapter}").status_code == 404
    assert _complete(url, "a", max_tokens=2).status_code == 200


def test_duplicate_names_and_unknown_unloads_are_refused(lora_server) -> None:
    url, folders = lora_server["url"], lora_server["folders"]
    for name in ("a", "stories260k"):
        r = httpx.post(f"{url}/v1/load_lora_adapter",
                       json={"lora_name": name, "lora_path": folders["c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


def _sample(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_load_and_unload_while_another_request_runs(lora_server) -> None:
    url, folders = lora_server["url"], lora_server["folders"]
    result: dict[str, Any] = {}

    def long_request() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "a", "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            result["chunks"] = [line for line in r.iter_lines() if line.startswith("data:")]
        result["status"] = r.status_code

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        running = None
        for _ in range(200):        # the long request shows in the per-adapter gauge
            running = _sample(url, "nybble:lora_num_requests_running", lora_name="a")
            if running:
                break
            threading.Event().wait(0.05)
        assert running == 1
        info = _sample(url, "nybble:lora_requests_info", max_lora="2")
        assert info is not None and info > 0
        r = httpx.post(f"{url}/v1/load_lora_adapter",
                       json={"lora_name": "c", "lora_path": folders["c"]})
        assert r.status_code == 200 and "added" in r.text
        c = _complete(url, "c")
        assert c.status_code == 200 and c.json()["choices"][0]["text"] == \
            _expected_text(url, folders["c"])
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200 and "removed" in r.text
        assert _complete(url, "a").status_code == 404
        assert "a" not in {c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
    finally:
        thread.join(timeout=120)
    assert result["status"] == 200 and result["chunks"][-1] == "data: [DONE]"
    last = json.loads(result["chunks"][-2][len("data: "):])
    assert last["model"] == "a" and last["choices"][0]["finish_reason"] == "length"
    # loaded again under its old name: a new id, and the same outputs
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "a", "lora_path": folders["a"]})
    assert r.status_code == 200
    assert _complete(url, "a").json()["choices"][0]["text"] == _expected_text(url,
                                                                              folders["a"])


def test_runtime_routes_exist_only_when_allowed() -> None:
    from nybble.server.app import build_app
    from nybble.server.config import ServerConfig
    from nybble.server.metrics import ServerMetrics

    def paths(config: ServerConfig) -> set[str]:
        return set(build_app(config, ServerMetrics("m")).openapi()["paths"])

    assert "/v1/load_lora_adapter" not in paths(ServerConfig())
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= \
        paths(ServerConfig(allow_runtime_lora_updating=True))


def test_lora_modules_forms(tmp_path: Path) -> None:
    import argparse

    from nybble.server.config import parse_lora_module

    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b", None)
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == \
        ("x", "/p", "m")
    for bad in ("no-equals", "=path", '{"name": "x"}', '{"name": "x", "path": "/p", "r": 1}'):
        with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
            parse_lora_module(bad)


def test_a_bad_lora_module_stops_the_server_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="LoRA adapter /nonexistent: no such folder") as info:
        proc, _ = start_server(tmp_path / "serve.log", "--enable-lora",
                               "--lora-modules", "a=/nonexistent")
        stop_server(proc)
    assert "Traceback" not in str(info.value)
    with pytest.raises(RuntimeError, match="--lora-modules needs --enable-lora"):
        proc, _ = start_server(tmp_path / "serve2.log", "--lora-modules", "a=/nonexistent")
        stop_server(proc)
