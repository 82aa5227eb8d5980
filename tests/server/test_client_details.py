"""What real clients read beyond the choices: the echoed ``X-Request-Id``, the prefix-cache
hits in ``usage.prompt_tokens_details``, several served model names, OpenAI-style 404s on
routes nybble does not serve, the Content-Type message, and ``content: null``."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import openai
import pytest

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

OK_BODY = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"model": "stories260k", "messages": [{"role": "user", "content": "Hi."}],
        "max_tokens": 4}


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


def test_request_id_header_is_echoed_and_names_the_request(server: Server) -> None:
    with server.http() as c:
        r = c.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": "trace-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        assert r.json()["id"] == "cmpl-trace-42"
        chat = c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "t-7"})
        assert chat.headers["x-request-id"] == "t-7" and chat.json()["id"] == "chatcmpl-t-7"
        bad = c.post("/v1/completions", json={**OK_BODY, "n": 0},
                     headers={"X-Request-Id": "bad-1"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
        plain = c.post("/v1/completions", json=OK_BODY)
        assert "x-request-id" not in plain.headers
        assert plain.json()["id"].startswith("cmpl-") and len(plain.json()["id"]) == 37
        odd = c.post("/v1/completions", json=OK_BODY, headers={"X-Request-Id": "a b"})
        assert "x-request-id" not in odd.headers     # not usable as an id: ignored
        assert odd.json()["id"] != "cmpl-a b"
        streamed = c.post("/v1/completions", json={**OK_BODY, "stream": True},
                          headers={"X-Request-Id": "s-1"})
        assert streamed.headers["x-request-id"] == "s-1"
        first = json.loads(streamed.text.split("\n")[0].removeprefix("data: "))
        assert first["id"] == "cmpl-s-1"


def test_usage_reports_prefix_cache_hits(server: Server) -> None:
    prompt = ("Once upon a time there was a little girl named Lily who loved to play in the "
              "park with her red ball and her dog.")
    with server.http() as c:
        first = c.post("/v1/completions", json={**OK_BODY, "prompt": prompt}).json()["usage"]
        again = c.post("/v1/completions", json={**OK_BODY, "prompt": prompt}).json()["usage"]
        chunks = c.post("/v1/completions", json={
            **OK_BODY, "prompt": prompt, "stream": True,
            "stream_options": {"include_usage": True}}).text
    block = server.stats()["block_size"]
    assert first["prompt_tokens"] > 2 * block
    # the second request finds every full block of the prompt but the one holding its last
    # token (that token is computed again to sample from)
    hit = (first["prompt_tokens"] - 1) // block * block
    assert again["prompt_tokens_details"] == {"cached_tokens": hit}
    assert first["prompt_tokens_details"]["cached_tokens"] in (0, hit)  # earlier tests
    events = [json.loads(line.removeprefix("data: ")) for line in chunks.split("\n")
              if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}


def test_openai_client_reads_cached_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a storyteller who tells short tales "
                 "about animals in the forest and their friends."},
                {"role": "user", "content": "Tell me one."}]
    for _ in range(2):
        out = client.chat.completions.create(model="stories260k", messages=messages,  # type: ignore[arg-type]
                                             max_tokens=2)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses", "/v1/audio/speech",
                                  "/nothing-here"])
def test_unknown_routes_get_openai_404(server: Server, path: str) -> None:
    with server.http() as c:
        error = _error(c.post(path, json={"model": "stories260k", "input": "Hi"}), 404)
    assert error["type"] == "invalid_request_error"


def test_json_without_content_type_gets_the_content_type_message(server: Server) -> None:
    with server.http() as c:
        r = c.post("/v1/completions", content=json.dumps(OK_BODY).encode())
        assert "content-type" not in r.request.headers
        message = _error(r, 400)["message"]
        wrong = _error(c.post("/v1/completions", content=json.dumps(OK_BODY),
                              headers={"Content-Type": "text/plain"}), 400)["message"]
    assert message.startswith("the request body must be a JSON object sent with "
                              "Content-Type: application/json, got no Content-Type")
    assert wrong.replace("Content-Type 'text/plain'", "no Content-Type") == message


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_null_content_is_a_400(server: Server, role: str) -> None:
    messages: list[dict[str, Any]] = [{"role": role, "content": None}]
    if role != "user":
        messages.append({"role": "user", "content": "Hi."})
    with server.http() as c:
        error = _error(c.post("/v1/chat/completions", json={**CHAT, "messages": messages}),
                       400)
    assert error["param"] == "messages" and "null" in error["message"]
    assert f"'{role}'" in error["message"]


def test_assistant_turn_with_tool_calls_may_have_null_content(server: Server) -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_several_served_model_names(tmp_path: Any) -> None:
    import httpx

    from tests.server.conftest import start_server, stop_server

    proc, url = start_server(tmp_path / "serve.log", "--served-model-name", "tiny", "story",
                             "--max-model-len", "128")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert ids == ["tiny", "story"]
            for name in ("tiny", "story"):
                r = c.post("/v1/completions", json={**OK_BODY, "model": name})
                assert r.status_code == 200 and r.json()["model"] == "tiny"
                assert c.get(f"/v1/models/{name}").json()["id"] == name
            error = _error(c.post("/v1/completions", json=OK_BODY), 404)
            assert "`tiny`, `story`" in error["message"]
    finally:
        stop_server(proc)


def test_multi_prompt_without_max_tokens_gives_each_prompt_its_own_rest(server: Server
                                                                        ) -> None:
    """``max_tokens: null`` with two prompts: each runs to the end of its own context
    (max_model_len 512), not to the smallest budget among them."""
    long_prompt, short_prompt = [1] + [5] * 499, [1, 5, 6]
    with server.http() as c:
        r = c.post("/v1/completions", json={
            **OK_BODY, "prompt": [long_prompt, short_prompt], "max_tokens": None,
            "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
    assert [ch["finish_reason"] for ch in choices] == ["length", "length"]
    assert r.json()["usage"]["completion_tokens"] == (512 - 500) + (512 - 3)
