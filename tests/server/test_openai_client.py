"""The official ``openai`` client against a real ``nybble serve`` (completions and chat)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest

if TYPE_CHECKING:
    from tests.server.conftest import Server

pytestmark = [pytest.mark.server]

PROMPT = "Once upon a time, there was a little girl named Lily."
GREEDY = {"temperature": 0.0}


def num_prompt_tokens(server: Server, **body: object) -> int:
    """Token count of a prompt (or chat messages) as the server tokenizes it."""
    with server.http() as c:
        r = c.post("/tokenize", json=body)
        r.raise_for_status()
        return int(r.json()["count"])


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["stories260k"]


def test_models_retrieve_gives_the_card_or_404(server: Server, client: openai.OpenAI) -> None:
    assert client.models.retrieve("stories260k") == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"   # type: ignore[index]
    with server.http() as c:
        assert c.head("/health").status_code == 200


def test_completion_usage_and_finish_reason(server: Server, client: openai.OpenAI) -> None:
    out = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=12,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == "stories260k"
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.usage is not None
    assert out.usage.prompt_tokens == num_prompt_tokens(server, prompt=PROMPT)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_stream_concat_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=40,
                                     **GREEDY)
    chunks = list(client.completions.create(model="stories260k", prompt=PROMPT,
                                            max_tokens=40, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


def test_chat_stream_concat_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tom had a red ball."}]
    full = client.chat.completions.create(model="stories260k", messages=messages,
                                          max_tokens=40, **GREEDY)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="stories260k", messages=messages,
                                                 max_tokens=40, stream=True, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_usage_counts_the_template(server: Server, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Stories."},
                {"role": "user", "content": "A cat sat."}]
    out = client.chat.completions.create(model="stories260k", messages=messages,
                                         max_completion_tokens=5,
                                         extra_body={"ignore_eos": True}, **GREEDY)
    assert out.usage.prompt_tokens == num_prompt_tokens(server, messages=messages)
    assert out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_n3_completion_indices(client: openai.OpenAI, stream: bool) -> None:
    kwargs = {"model": "stories260k", "prompt": PROMPT, "max_tokens": 8, "n": 3,
              "temperature": 1.0, "seed": 7}
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        indices = sorted({c.choices[0].index for c in chunks if c.choices})
        finished = sorted(c.choices[0].index for c in chunks
                          if c.choices and c.choices[0].finish_reason)
        assert finished == [0, 1, 2]
    else:
        indices = [c.index for c in client.completions.create(**kwargs).choices]
    assert indices == [0, 1, 2]


def test_n3_chat_indices(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="stories260k", n=3, max_tokens=8, seed=3,
                                         messages=[{"role": "user", "content": "Hi."}],
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 3 * 8


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_include_usage_final_chunk(server: Server, client: openai.OpenAI, api: str) -> None:
    opts = {"include_usage": True}
    if api == "completions":
        chunks = list(client.completions.create(
            model="stories260k", prompt=PROMPT, max_tokens=9, n=2, stream=True,
            stream_options=opts, extra_body={"ignore_eos": True}, **GREEDY))
        prompt_tokens = num_prompt_tokens(server, prompt=PROMPT)
    else:
        messages = [{"role": "user", "content": "The sun was warm."}]
        chunks = list(client.chat.completions.create(
            model="stories260k", messages=messages, max_tokens=9, n=2, stream=True,
            stream_options=opts, extra_body={"ignore_eos": True}, **GREEDY))
        prompt_tokens = num_prompt_tokens(server, messages=messages)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == prompt_tokens
    assert last.usage.completion_tokens == 2 * 9
    assert last.usage.total_tokens == prompt_tokens + 18
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_forms_give_the_same_text(server: Server, client: openai.OpenAI) -> None:
    with server.http() as c:
        ids = c.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    other = "The dog ran to the park."
    single = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=10,
                                       **GREEDY).choices[0].text
    by_ids = client.completions.create(model="stories260k", prompt=ids, max_tokens=10,
                                       **GREEDY).choices[0].text
    assert by_ids == single
    multi = client.completions.create(model="stories260k", prompt=[other, PROMPT], n=2,
                                      max_tokens=10, **GREEDY)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.choices[2].text == multi.choices[3].text == single
    lists = client.completions.create(model="stories260k", prompt=[ids, ids], max_tokens=10,
                                      **GREEDY)
    assert [c.text for c in lists.choices] == [single, single]


def test_echo_stop_and_seed(client: openai.OpenAI) -> None:
    echoed = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=6,
                                       echo=True, **GREEDY).choices[0].text
    plain = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=6,
                                      **GREEDY).choices[0].text
    assert echoed == PROMPT + plain
    long = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=60,
                                     **GREEDY).choices[0]
    assert "." in long.text, "the greedy story should contain a sentence end"
    stopped = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=60,
                                        stop=["."], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == long.text[: long.text.index(".")]
    a, b = (client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=20,
                                      temperature=1.0, seed=1234).choices[0].text
            for _ in range(2))
    assert a == b


def test_completion_logprobs_format(client: openai.OpenAI) -> None:
    out = client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=8,
                                    logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == 8 == len(lp.token_logprobs)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        assert logprob <= 0.0
        # greedy: the sampled token is the most likely one
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert top[token] == pytest.approx(logprob, abs=1e-5)


def test_chat_logprobs_format(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="stories260k", messages=[{"role": "user", "content": "A bird sang."}],
        max_tokens=6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
        **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert bytes(t.bytes) == t.token.encode()
