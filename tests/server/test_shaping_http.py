"""Logit shaping and structured output over HTTP, on both endpoints: the server's tokens equal
the offline engine's for the same parameters (checked against the formulas in
tests/runtime/sample/test_logit_shaping_engine.py), JSON outputs validate against their schema
(``jsonschema``), streamed or not, and bad values are 400s naming the parameter."""
from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL
from tests.runtime.sample.test_structured_output import PERSON, closing_bias
from tests.server.conftest import Server, core_pid
from tests.server.test_process import _maps

pytestmark = [pytest.mark.server]

CHAT = {"model": "stories260k", "messages": [{"role": "user", "content": "Tell me a story"}]}
COMPLETION = {"model": "stories260k", "prompt": "The dog"}
SHAPING = {"logit_bias": {"262": 3.0, "278": -100}, "presence_penalty": 0.8,
           "frequency_penalty": 0.6, "repetition_penalty": 1.2, "min_tokens": 12,
           "bad_words": ["was"], "max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(DEFAULT_MODEL, max_num_seqs=8)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as c:
        return c.post(path, json=body)


def test_completion_shaping_equals_the_offline_engine(server: Server, offline: LLM) -> None:
    r = _post(server, "/v1/completions", {**COMPLETION, **SHAPING})
    assert r.status_code == 200, r.text
    p = SamplingParams(temperature=0.0, max_tokens=24, logit_bias={262: 3.0, 278: -100.0},
                       presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.2,
                       min_tokens=12, bad_words=["was"])
    want = offline.generate(["The dog"], p, use_tqdm=False)[0].outputs[0]
    plain = offline.generate(["The dog"], SamplingParams(temperature=0.0, max_tokens=24),
                             use_tqdm=False)[0].outputs[0]
    assert want.text != plain.text
    assert r.json()["choices"][0]["text"] == want.text


@pytest.mark.parametrize("extra,params", [
    ({k: v for k, v in SHAPING.items()}, SamplingParams(
        temperature=0.0, max_tokens=24, logit_bias={262: 3.0, 278: -100.0},
        presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.2, min_tokens=12,
        bad_words=["was"])),
    ({"allowed_token_ids": [13, 262, 278, 300, 2], "max_tokens": 10, "temperature": 0.0},
     SamplingParams(temperature=0.0, max_tokens=10, allowed_token_ids=[13, 262, 278, 300, 2])),
])
def test_chat_shaping_equals_the_offline_engine(server: Server, offline: LLM, extra: dict,
                                                params: SamplingParams) -> None:
    r = _post(server, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 200, r.text
    with server.http() as c:
        ids = c.post("/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    want = offline.generate([ids], params, use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format(server: Server, path: str, base: dict,
                                     stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3}):
        body = {**base, **sampling, "max_tokens": 200, "response_format": fmt, "n": 2,
                "stream": stream}
        for text in _texts(server, path, body):
            jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
def test_json_object_and_vllm_extras(server: Server, path: str, base: dict) -> None:
    bias = {str(k): v for k, v in closing_bias().items()}
    body = {**base, "temperature": 0.0, "max_tokens": 100, "logit_bias": bias,
            "response_format": {"type": "json_object"}}
    assert all(isinstance(json.loads(t), dict) for t in _texts(server, path, body))
    body = {**base, "temperature": 0.7, "seed": 1, "max_tokens": 50, "n": 3,
            "guided_choice": ["cat", "dog"]}
    assert all(t in ("cat", "dog") for t in _texts(server, path, body))
    body = {**base, "temperature": 0.0, "max_tokens": 50, "guided_regex": "[0-9]{3}-[a-z]{2}"}
    assert all(len(t) == 6 and t[3] == "-" for t in _texts(server, path, body))
    body = {**base, "temperature": 0.0, "max_tokens": 200, "guided_json": PERSON}
    for t in _texts(server, path, body):
        jsonschema.validate(json.loads(t), PERSON)


def _texts(server: Server, path: str, body: dict) -> list[str]:
    if not body.get("stream"):
        r = _post(server, path, body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert all(c["finish_reason"] == "stop" for c in choices), choices
        return [c["text"] if "text" in c else c["message"]["content"] for c in choices]
    texts: dict[int, str] = {}
    with server.http() as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                piece = ch["text"] if "text" in ch else ch["delta"].get("content") or ""
                texts[ch["index"]] = texts.get(ch["index"], "") + piece
    return list(texts.values())


@pytest.mark.parametrize("path,base", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"guided_regex": "(?=a)b"}, "guided_regex"),          # the grammar engine refuses it
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"allowed_token_ids": [600]}, "allowed_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"bad_words": [" "]}, "bad_words"),
])
def test_bad_values_are_400s(server: Server, path: str, base: dict, extra: dict,
                             param: str) -> None:
    r = _post(server, path, {**base, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert _post(server, path, {**base, "max_tokens": 4}).status_code == 200


def test_the_api_process_stays_free_of_torch_and_xgrammar(server: Server) -> None:
    """After structured-output requests (this module's, run before), grammars were compiled
    in the engine core only: the API process maps neither torch nor xgrammar."""
    body = {**COMPLETION, "max_tokens": 20, "guided_choice": ["yes", "no"]}
    assert _texts(server, "/v1/completions", body)[0] in ("yes", "no")
    maps = _maps(server.pid)
    assert "libtorch" not in maps and "xgrammar" not in maps
    assert "xgrammar" in _maps(core_pid(server.pid))   # the check sees it where it is


def test_a_streamed_request_whose_grammar_does_not_compile_gets_an_in_band_error(
        server: Server) -> None:
    """The gate passes a look-ahead (Python's ``re`` takes it); xgrammar refuses it in the
    core after the stream's headers went out: the error comes in-band, naming the field."""
    body = {**COMPLETION, "max_tokens": 8, "stream": True, "guided_regex": "(?=a)b"}
    with server.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["param"] == "guided_regex", events
    assert server.wait_idle()["num_free_blocks"] > 0
