"""vLLM's chat options (``add_generation_prompt``, ``continue_final_message``,
``chat_template``, ``chat_template_kwargs``, ``echo``): the prompt the server renders equals
transformers' ``apply_chat_template`` with the same options, token for token."""
from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from nybble.config import DEFAULT_MODEL

from .conftest import Server

pytestmark = pytest.mark.server

# A turn-based template (ChatML-like, with an end-of-turn after every message and a
# generation header), so the options change the rendered text
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if shout is defined and shout %}!{% endif %}</turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": "Once upon a time, there was a dog"}]


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def _hf_ids(hf_tok: Any, messages: list[dict[str, str]], **options: Any) -> list[int]:
    kwargs = options.pop("chat_template_kwargs", {}) or {}
    out = hf_tok.apply_chat_template(messages, tokenize=True, **options, **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _tokenize(server: Server, **body: Any) -> list[int]:
    with server.http() as c:
        r = c.post("/tokenize", json={"model": "stories260k", **body})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _chat(server: Server, **body: Any) -> Any:
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={"model": "stories260k", "temperature": 0,
                                                 "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("options", [
    {"add_generation_prompt": True},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": True, "chat_template_kwargs": {"shout": True}},
    {"add_generation_prompt": False, "continue_final_message": True,
     "chat_template_kwargs": {"shout": True}},
])
def test_rendered_prompt_equals_transformers(server: Server, hf_tok, options) -> None:
    want = _hf_ids(hf_tok, MESSAGES, chat_template=TEMPLATE, **dict(options))
    got = _tokenize(server, messages=MESSAGES, chat_template=TEMPLATE, **options)
    assert got == want
    # the chat endpoint renders the same prompt
    body = _chat(server, messages=MESSAGES, chat_template=TEMPLATE, **options)
    assert body["usage"]["prompt_tokens"] == len(want)


def test_continue_final_message_leaves_the_turn_open(server: Server, hf_tok) -> None:
    ids = _tokenize(server, messages=MESSAGES, chat_template=TEMPLATE,
                    add_generation_prompt=False, continue_final_message=True)
    text = hf_tok.decode(ids)
    assert text.endswith(MESSAGES[-1]["content"])
    assert "</turn>" not in text.split("<|assistant|>")[-1]


def test_bundled_template_and_echo(server: Server, hf_tok) -> None:
    # the model's own template, continued: the answer continues the assistant's text
    want = _hf_ids(hf_tok, MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert _tokenize(server, messages=MESSAGES, add_generation_prompt=False,
                     continue_final_message=True) == want
    plain = _chat(server, messages=MESSAGES, add_generation_prompt=False,
                  continue_final_message=True)["choices"][0]["message"]["content"]
    echoed = _chat(server, messages=MESSAGES, add_generation_prompt=False,
                   continue_final_message=True, echo=True)["choices"][0]["message"]["content"]
    assert echoed == MESSAGES[-1]["content"] + plain
    # echo with the generation prompt and a final user message: nothing to echo (vLLM)
    user_only = MESSAGES[:1]
    assert _chat(server, messages=user_only, echo=True)["choices"][0]["message"]["content"] \
        == _chat(server, messages=user_only)["choices"][0]["message"]["content"]


def test_streamed_echo_leads_the_content(server: Server) -> None:
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={
            "model": "stories260k", "messages": MESSAGES, "temperature": 0, "max_tokens": 6,
            "add_generation_prompt": False, "continue_final_message": True, "echo": True,
            "stream": True})
        assert r.status_code == 200
        parts = [json.loads(line[6:]) for line in r.iter_lines()
                 if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in parts if p["choices"])
    whole = _chat(server, messages=MESSAGES, max_tokens=6, add_generation_prompt=False,
                  continue_final_message=True, echo=True)["choices"][0]["message"]["content"]
    assert text == whole


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_refused(server: Server, body: dict[str, Any], param: str) -> None:
    with server.http() as c:
        r = c.post("/v1/chat/completions", json={"model": "stories260k",
                                                 "messages": MESSAGES, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
