"""Bad inputs get their status and an OpenAI error body; the server keeps serving."""
from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import openai
import pytest

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

OK_BODY = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"model": "stories260k", "messages": [{"role": "user", "content": "Hi."}]}

CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body (dict, or raw str), status, param)
    ("negative-temperature", "/v1/completions", {**OK_BODY, "temperature": -0.5}, 400,
     "temperature"),
    ("max-tokens-negative", "/v1/completions", {**OK_BODY, "max_tokens": -1}, 400,
     "max_tokens"),
    ("n-0", "/v1/completions", {**OK_BODY, "n": 0}, 400, "n"),
    ("top-p-0", "/v1/completions", {**OK_BODY, "top_p": 0.0}, 400, "top_p"),
    ("top-p-over-1", "/v1/completions", {**OK_BODY, "top_p": 1.5}, 400, "top_p"),
    ("too-long", "/v1/completions", {**OK_BODY, "max_tokens": 600}, 400, "max_tokens"),
    ("empty-prompt", "/v1/completions", {**OK_BODY, "prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", {**OK_BODY, "prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {**OK_BODY, "prompt": [1, 99999]}, 400,
     "prompt"),
    ("wrong-type", "/v1/completions", {**OK_BODY, "temperature": "hot"}, 400, "temperature"),
    ("missing-prompt", "/v1/completions", {"model": "stories260k"}, 400, "prompt"),
    ("malformed-json", "/v1/completions", '{"prompt": "Hi", "max_tokens": ', 400, None),
    ("unknown-model", "/v1/completions", {**OK_BODY, "model": "gpt-4"}, 404, "model"),
    ("chat-empty-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400,
     "messages"),
    ("chat-too-long", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 510}, 400,
     "max_completion_tokens"),
    ("chat-negative-temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400,
     "temperature"),
    ("chat-unknown-model", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("stream-bad-param", "/v1/completions", {**OK_BODY, "stream": True, "n": -2}, 400, "n"),
    ("n-over-max-num-seqs", "/v1/completions", {**OK_BODY, "n": 1000}, 400, "n"),
    ("nan-temperature", "/v1/completions",
     '{"model": "stories260k", "prompt": "Hi", "temperature": NaN}', 400, "temperature"),
    ("presence-penalty-range", "/v1/completions", {**OK_BODY, "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("logit-bias-outside-vocab", "/v1/completions", {**OK_BODY, "logit_bias": {"512": 10}},
     400, "logit_bias"),
    ("logit-bias-range", "/v1/completions", {**OK_BODY, "logit_bias": {"5": 101}}, 400,
     "logit_bias"),
    ("best-of-under-n", "/v1/completions", {**OK_BODY, "n": 2, "best_of": 1}, 400, "best_of"),
    ("best-of-streamed", "/v1/completions", {**OK_BODY, "best_of": 3, "stream": True}, 400,
     "best_of"),
    ("suffix", "/v1/completions", {**OK_BODY, "suffix": "The end."}, 400, "suffix"),
    ("chat-tools", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat-unknown-format", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("chat-unknown-role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages"),
    # The request gate: every range, named with the endpoint's own parameter names.
    # max_tokens left out is 16: 500 + 16 tokens do not fit
    ("completion-no-room", "/v1/completions", {"model": "stories260k", "prompt": [1] * 500},
     400, "max_tokens"),
    # max_tokens: null is the rest of the context (vLLM): a full prompt leaves none
    ("completion-null-no-room", "/v1/completions", {**OK_BODY, "prompt": [1] * 512,
                                                    "max_tokens": None}, 400, "prompt"),
    ("chat-no-room", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "Hi. " * 600}]}, 400, "messages"),
    ("chat-max-completion-tokens-negative", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("chat-continue-and-generation-prompt", "/v1/chat/completions",
     {**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("logprobs-over-max", "/v1/completions", {**OK_BODY, "logprobs": 21}, 400, "logprobs"),
    ("chat-top-logprobs-over-max", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", "/v1/chat/completions",
     {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("seed-over-64-bits", "/v1/completions",
     {**OK_BODY, "temperature": 0.8, "seed": 18446744073709551616}, 400, "seed"),
    ("top-k-negative", "/v1/completions", {**OK_BODY, "top_k": -5}, 400, "top_k"),
    ("min-p-over-1", "/v1/completions", {**OK_BODY, "min_p": 1.5}, 400, "min_p"),
    ("empty-stop-string", "/v1/completions", {**OK_BODY, "stop": [""]}, 400, "stop"),
    ("stop-token-out-of-vocab", "/v1/completions", {**OK_BODY, "stop_token_ids": [600]}, 400,
     "stop_token_ids"),
    ("echo-with-logprobs-streamed", "/v1/completions",
     {**OK_BODY, "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("second-prompt-bad", "/v1/completions", {**OK_BODY, "prompt": [[1, 5], [1, 99999]]}, 400,
     "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_gets_error_body(server: Server, path: str, body: Any, status: int,
                                   param: str | None) -> None:
    with server.http() as c:
        if isinstance(body, str):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"] == "invalid_request_error"
        assert error["param"] == param
        ok = c.post("/v1/completions", json=OK_BODY)
        assert ok.status_code == 200
        assert ok.json()["usage"]["completion_tokens"] > 0


def test_too_long_message_names_both_numbers(server: Server) -> None:
    with server.http() as c:
        r = c.post("/v1/completions", json={**OK_BODY, "max_tokens": 600})
    message = r.json()["error"]["message"]
    assert "512" in message and "600" in message


def test_over_length_is_one_message_for_both_endpoints(server: Server) -> None:
    with server.http() as c:
        completion = c.post("/v1/completions", json={**OK_BODY, "prompt": [1] * 10,
                                                      "max_tokens": 600}).json()["error"]
        chat = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 600}).json()["error"]
    assert completion["message"].startswith(
        "prompt + max_tokens must be <= max_model_len (512 tokens), got 10 prompt tokens + "
        "600 max_tokens = 610")
    assert chat["message"].startswith("messages + max_tokens must be <= max_model_len (512 "
                                      "tokens), got ")
    assert chat["param"] == "max_tokens"


def test_openai_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="stories260k", prompt="Hi", temperature=-1)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user",
                                                                  "content": "Hi"}])


def test_bad_requests_do_not_disturb_a_running_stream(server: Server,
                                                      client: openai.OpenAI) -> None:
    body = {"model": "stories260k", "prompt": "The little fox", "max_tokens": 120,
            "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    expected = client.completions.create(**body).choices[0].text
    texts: list[str] = []

    def stream() -> None:
        chunks = client.completions.create(stream=True, **body)
        texts.append("".join(c.choices[0].text for c in chunks if c.choices))

    t = threading.Thread(target=stream)
    t.start()
    with server.http() as c:
        for _, path, bad, status, _ in CASES:
            if isinstance(bad, dict):
                assert c.post(path, json=bad).status_code == status
    t.join(timeout=120)
    assert texts == [expected]


@pytest.mark.slow
def test_busy_port_fails_fast_with_one_line(server: Server) -> None:
    import subprocess
    import sys

    port = server.url.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "nybble", "serve", "--port", port],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "serving" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain"])
def test_json_under_another_content_type_names_the_content_type(server: Server,
                                                                ctype: str) -> None:
    """``curl -d`` without ``-H 'Content-Type: application/json'`` sends a form: the 400 says
    what to change, not only that the body is not an object."""
    with server.http() as c:
        r = c.post("/v1/completions", content=json.dumps(OK_BODY),
                   headers={"Content-Type": ctype})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message and ctype in message
