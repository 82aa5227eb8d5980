"""Issue 15's server points on the session server: explicit nulls, streaming without empty
deltas, logprob bytes and offsets through HTTP, the API key on every non-probe route, no
model path, lone surrogates, 500s, multi-prompt batching, metrics of aborted and rejected
requests, /health under a large request, and the OpenAPI document."""
from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from nybble.version import __version__

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

GREEDY = {"model": "stories260k", "prompt": "The dog", "max_tokens": 12, "temperature": 0.0}
CHAT = {"model": "stories260k", "messages": [{"role": "user", "content": "The dog"}],
        "max_tokens": 12, "temperature": 0.0}


def _answer(r: httpx.Response) -> dict[str, Any]:
    """A response body without its per-response fields (id, created)."""
    assert r.status_code == 200, r.text
    body = r.json()
    body.pop("id"), body.pop("created")
    return dict(body)


@pytest.mark.parametrize("path,base,nulls", [
    ("/v1/completions", GREEDY,
     ["n", "logprobs", "echo", "stream", "stream_options", "stop", "seed", "top_p", "top_k",
      "min_p", "ignore_eos", "stop_token_ids", "user", "best_of", "suffix", "logit_bias",
      "presence_penalty", "frequency_penalty", "repetition_penalty", "response_format",
      "tools", "include_stop_str_in_output", "skip_special_tokens",
      "spaces_between_special_tokens"]),
    ("/v1/chat/completions", CHAT,
     ["n", "logprobs", "top_logprobs", "stream", "stream_options", "stop", "seed", "top_p",
      "top_k", "min_p", "ignore_eos", "stop_token_ids", "user", "max_completion_tokens",
      "response_format", "tools", "best_of", "echo", "add_generation_prompt",
      "continue_final_message", "chat_template", "chat_template_kwargs"]),
])
def test_explicit_null_is_the_field_left_out(server: Server, path: str, base: dict[str, Any],
                                             nulls: list[str]) -> None:
    with server.http() as c:
        expected = _answer(c.post(path, json=base))
        for name in nulls:
            assert _answer(c.post(path, json={**base, name: None})) == expected, name
        assert _answer(c.post(path, json={**base, **dict.fromkeys(nulls)})) == expected
        # completions' max_tokens left out is 16; null is the rest of the context (vLLM)
        left_out = {k: v for k, v in GREEDY.items() if k != "max_tokens"}
        sixteen = c.post("/v1/completions", json={**left_out, "ignore_eos": True}).json()
        assert sixteen["usage"]["completion_tokens"] == 16
        rest = c.post("/v1/completions", json={**GREEDY, "max_tokens": None,
                                                "ignore_eos": True}).json()["usage"]
        assert rest["prompt_tokens"] + rest["completion_tokens"] == 512


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_stream_sends_no_empty_delta_before_the_last(server: Server,
                                                          logprobs: bool) -> None:
    """A long stop string holds text back for several tokens: those tokens wait for the next
    chunk with text (logprobs included), instead of empty deltas."""
    body = {**CHAT, "max_tokens": 40, "stop": ["this stop string never appears"],
            "stream": True, "ignore_eos": True, "n": 2}
    if logprobs:
        body.update(logprobs=True, top_logprobs=2)
    with server.http() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = _events(r)
        whole = c.post("/v1/chat/completions", json={**body, "stream": False}).json()
    for index in range(2):
        chunks = [ch for e in events for ch in e["choices"] if ch["index"] == index]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        for ch in chunks[1:-1]:
            assert ch["delta"].get("content"), ch
            assert ch["finish_reason"] is None
        assert chunks[-1]["finish_reason"] == "length"
        text = "".join(ch["delta"].get("content", "") for ch in chunks)
        assert text == whole["choices"][index]["message"]["content"]
        if logprobs:
            tokens = [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["content"]]
            assert len(tokens) == 40
            assert tokens == whole["choices"][index]["logprobs"]["content"]


def test_logprob_bytes_and_offsets_through_http(server: Server) -> None:
    """A hot, seeded sample: the chat bytes add up to the text, the completion tokens too,
    and every offset indexes the returned text. (The bundled model never ranks its
    byte-fallback tokens high enough to sample one: multi-token characters are covered
    exactly by ``test_logprobs.py``.)"""
    body = {"max_tokens": 120, "temperature": 1.6, "seed": 7, "ignore_eos": True}
    with server.http() as c:
        comp = c.post("/v1/completions", json={**body, "prompt": "Lily saw a",
                                               "logprobs": 2}).json()
        chat = c.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "Lily saw a"}],
            "logprobs": True, "top_logprobs": 2}).json()
    text = comp["choices"][0]["text"]
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 120 and "".join(lp["tokens"]) == text
    for token, offset, top in zip(lp["tokens"], lp["text_offset"], lp["top_logprobs"],
                                  strict=True):
        assert text[offset:offset + len(token)] == token and len(top) == 2
    choice = chat["choices"][0]
    content = choice["logprobs"]["content"]
    assert b"".join(bytes(t["bytes"]) for t in content).decode() == \
        choice["message"]["content"]
    for t in content:
        assert bytes(t["bytes"]) == t["token"].encode()
        assert all(bytes(a["bytes"]) == a["token"].encode() for a in t["top_logprobs"])


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/internal/stats", None)])
def test_tokenize_detokenize_and_stats_need_the_key(server: Server, method: str, path: str,
                                                    body: Any) -> None:
    r = httpx.request(method, f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with server.http() as c:
        assert c.request(method, path, json=body).status_code == 200


def test_models_do_not_reveal_the_path(server: Server) -> None:
    with server.http() as c:
        (card,) = c.get("/v1/models").json()["data"]
    assert card["root"] == "stories260k" and "/" not in json.dumps(card)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "Hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "Hi", "model": "\\udc00x"}', "model"),
    ("/v1/completions", '{"prompt": ["a", "\\udbff"]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_400(server: Server, path: str, body: str, param: str) -> None:
    with server.http() as c:
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert "lone surrogate" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=GREEDY).status_code == 200


def test_non_text_parts_and_stream_options_are_400(server: Server) -> None:
    with server.http() as c:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = c.post(path, json={"messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]})
            assert r.status_code == 400 and "'image_url'" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={**GREEDY, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_three_hundred_prompts_are_submitted_together(server: Server) -> None:
    server.wait_idle()
    steps = server.stats()["num_steps"]
    prompts = [f"Story {i}: the cat" for i in range(300)]
    with server.http() as c:
        r = c.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 300
    # 300 sequences of ~7 tokens: two steps at max_num_seqs 256, not one step per prompt
    assert server.wait_idle()["num_steps"] - steps <= 10


def test_aborted_and_rejected_requests_in_the_metrics(server: Server) -> None:
    server.wait_idle()
    ttft = server.metric("nybble:time_to_first_token_seconds_count")
    aborted = server.metric("nybble:request_success_total", finished_reason="abort")
    with server.http() as c:
        assert c.post("/v1/completions", json={**GREEDY, "temperature": -1}).status_code == 400
        # NOTE: n=16 keeps the request running well past the client's leaving (one 400-token
        # sequence takes ~0.1 s on the fused CPU step, about the disconnect poll's period)
        with c.stream("POST", "/v1/completions",
                      json={**GREEDY, "max_tokens": 400, "n": 16, "ignore_eos": True,
                            "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
    server.wait_idle()
    assert server.metric("nybble:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("nybble:time_to_first_token_seconds_count") == ttft + 1


def test_health_answers_during_a_large_request(server: Server) -> None:
    """A large /tokenize (2 MiB, the default body limit) and a large logprobs answer run on
    worker threads: /health keeps answering meanwhile. The figures are in
    benchmarks/serve_limits.py; here only a generous bound (the machine is shared)."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with server.http() as c:
            t0 = time.perf_counter()
            r = c.post("/tokenize", json={"prompt": "Once upon a time, " * 110_000})
            assert r.status_code == 200 and r.json()["count"] > 500_000
            r = c.post("/v1/completions", json={"prompt": "Hi", "n": 16, "max_tokens": 200,
                                                "logprobs": 20, "ignore_eos": True})
            assert r.status_code == 200
            elapsed = time.perf_counter() - t0
    finally:
        done.set()
        poller.join()
    latencies.sort()
    assert len(latencies) > 20
    assert latencies[len(latencies) // 2] < 0.1
    assert latencies[-1] < max(1.0, elapsed / 5)


def test_openapi_documents_what_the_server_answers(server: Server) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert schema["info"]["version"] == __version__
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            codes = set(op["responses"])
            assert "422" not in codes, (path, method)
            if "requestBody" in op:
                assert {"400", "401", "413"} <= codes, (path, method)
            assert "200" in codes, (path, method)
    for path in ("/v1/completions", "/v1/chat/completions"):
        ok = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith("Response")
        assert "text/event-stream" in ok
    version = schema["paths"]["/version"]["get"]["responses"]["200"]["content"]
    assert version["application/json"]["schema"]["$ref"].endswith("VersionResponse")
    assert "securitySchemes" in schema["components"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(server: Server,
                                                                   stream: bool) -> None:
    """Greedy "The dog" reads " was a big, red ball" after exactly 8 tokens: with
    ``max_tokens`` 8 and ``stop: ["ball"]`` the text is cut by the stop string, so the finish
    reason is "stop" (not "length"); one token fewer never completes "ball"."""
    body = {**GREEDY, "max_tokens": 8, "stop": ["ball"], "stream": stream}
    with server.http() as c:
        plain = c.post("/v1/completions", json={**GREEDY, "max_tokens": 8}).json()["choices"][0]
        assert plain["text"].endswith("ball") and plain["finish_reason"] == "length"
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            text = "".join(ch["text"] for ch in chunks)
            reasons = [ch["finish_reason"] for ch in chunks if ch["finish_reason"]]
            assert reasons == ["stop"]
        else:
            choice = c.post("/v1/completions", json=body).json()["choices"][0]
            text = choice["text"]
            assert choice["finish_reason"] == "stop"
        assert text == plain["text"][:-len("ball")]
        short = c.post("/v1/completions",
                       json={**body, "max_tokens": 7, "stream": False}).json()["choices"][0]
        assert short["finish_reason"] == "length" and "ball" not in short["text"]


def _validate_stream(url: str, doc: dict[str, Any], path: str, body: dict[str, Any],
                     api_key: str) -> list[str]:
    """schemathesis' failure titles for a real streamed answer checked against ``doc``."""
    import requests
    import schemathesis

    from nybble.bench.serve_fuzz import _checks

    op = next(o.ok() for o in schemathesis.openapi.from_dict(doc).get_all_operations()
              if o.ok().path == path)
    case = op.Case(body=body, media_type="application/json")
    headers = {"Authorization": f"Bearer {api_key}"}
    response = case.call(base_url=url, session=requests.Session(), headers=headers)
    assert response.status_code == 200 and response.text.startswith("data: ")
    try:
        case.validate_response(response, checks=_checks(), headers=headers)
    except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 -- a group of failures
        return [str(getattr(f, "title", f)) for f in getattr(e, "exceptions", [e])]
    return []


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**GREEDY, "stream": True, "logprobs": 2,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 2,
                              "stream_options": {"include_usage": True}}),
])
def test_openapi_documents_each_stream_event(server: Server, path: str,
                                             body: dict[str, Any]) -> None:
    """Every event of a real stream validates against the document's event schema (its data
    is the chunk's JSON or [DONE]), and a document that names the wrong model for the data
    makes the same stream fail: the event schema is checked, not just present."""
    with server.http() as c:
        doc = c.get("/openapi.json").json()
    assert _validate_stream(server.url, doc, path, body, server.api_key) == []
    event = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    event["schema"]["properties"]["data"]["else"]["contentSchema"] = {
        "$ref": "#/components/schemas/ErrorResponse"}
    assert _validate_stream(server.url, doc, path, body, server.api_key) == [
        "SSE event violates schema"]
