"""Scoring on ``/v1/completions`` (``echo`` + ``logprobs`` + ``max_tokens: 0``, against
transformers' log-softmax), ``best_of``, ``include_stop_str_in_output``, and the special-token
options, on the session server (prefix caching on, the default)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nybble.config import DEFAULT_MODEL

from .conftest import Server

pytestmark = pytest.mark.server

TOL = 1e-4
PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play",
           "Tom had a big red ball."]


@pytest.fixture(scope="module")
def hf() -> Any:
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def _post(server: Server, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    with server.http() as c:
        r = c.post(path, json={"model": "stories260k", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_echoed(hf: Any, ids: list[int], lp: dict[str, Any], text: str, k: int) -> None:
    """The first ``len(ids)`` positions of ``lp`` are the prompt's: ``null`` first, then
    transformers' values, top-``k`` dicts, and offsets that index ``text``."""
    ref = _hf_logprobs(hf, ids)
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < TOL, i
        top = lp["top_logprobs"][i]
        assert len(top) == k
        assert abs(max(top.values()) - ref[i - 1].max().item()) < TOL
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    for token, at in zip(lp["tokens"][1:], offsets[1:]):
        assert text[at:at + len(token)] == token


def test_echo_logprobs_max_tokens_0_match_transformers(server: Server, hf, hf_tok) -> None:
    ids = [hf_tok(p).input_ids for p in PROMPTS]
    # text prompts and the same prompts as token ids, batched in one request
    for prompt in (PROMPTS, ids):
        body = _post(server, {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0})
        assert body["usage"]["completion_tokens"] == 0
        for choice, p, want in zip(body["choices"], PROMPTS, ids):
            assert choice["text"] == p and choice["finish_reason"] == "length"
            assert len(choice["logprobs"]["tokens"]) == len(want)
            assert choice["logprobs"]["tokens"][0] == "<s>"
            _check_echoed(hf, want, choice["logprobs"], choice["text"], 2)


def test_echo_logprobs_with_generated_tokens(server: Server, hf, hf_tok) -> None:
    ids = hf_tok(PROMPTS[0]).input_ids
    plain = _post(server, {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0,
                           "logprobs": 1})["choices"][0]
    body = _post(server, {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0,
                          "logprobs": 1, "echo": True})
    choice = body["choices"][0]
    assert choice["text"] == PROMPTS[0] + plain["text"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 5
    _check_echoed(hf, ids, lp, choice["text"], 1)
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    # NOTE: equal up to float32 rounding: the plain request may reuse cached prefix blocks,
    # the scoring one computes the whole prompt in other batch shapes
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"],
                                                     abs=TOL)
    # the generated tokens' offsets index the whole text: they start after the echo
    assert lp["text_offset"][n:] == [len(PROMPTS[0]) + o
                                     for o in plain["logprobs"]["text_offset"]]


def test_max_tokens_0_without_echo_is_empty(server: Server) -> None:
    body = _post(server, {"prompt": PROMPTS[1], "max_tokens": 0})
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    full = _post(server, {"prompt": [1] * 512, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert len(full["choices"][0]["logprobs"]["token_logprobs"]) == 512


def test_best_of_returns_the_n_best_by_cumulative_logprob(server: Server) -> None:
    common = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.0, "seed": 7}
    # sample i of a seeded request draws from its own generator: the 5 candidates of
    # best_of 5 are exactly the 5 samples of n 5
    every = _post(server, {**common, "n": 5, "logprobs": 0})["choices"]
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every}
    assert len(score) == 5, "the candidates should differ"
    want = sorted(score, key=score.get, reverse=True)[:2]
    best = _post(server, {**common, "n": 2, "best_of": 5})["choices"]
    assert [c["text"] for c in best] == want
    assert [c["index"] for c in best] == [0, 1]


def test_include_stop_str_in_output(server: Server) -> None:
    base = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    text = _post(server, base)["choices"][0]["text"]
    stop = text[6:9]
    cut = text[:text.index(stop)]
    without = _post(server, {**base, "stop": [stop]})["choices"][0]
    assert without["text"] == cut and without["finish_reason"] == "stop"
    kept = _post(server, {**base, "stop": [stop], "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == cut + stop
