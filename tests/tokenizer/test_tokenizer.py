"""nybble's torch-free tokenizer gives transformers' ids, text and chat prompts; its streaming
decoder adds up to the text of the whole stream; a folder without tokenizer.json converts."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError
from nybble.tokenizer.hf_tokenizer import load_tokenizer
from nybble.tokenizer.tokenizer import Tokenizer
from tests.conftest import shared_folders

TEXTS = ["Once upon a time", " a  b\n c ", "é 🙂 日本", "", "Tom said: \"Hi!\" <s> and </s>."]
FOLDERS = [DEFAULT_MODEL] + [
    d for d in shared_folders("models/*", "fixtures/quant/tiny-*")
    if not isinstance(d, str) or os.path.isfile(os.path.join(d, "tokenizer.json"))]
STORIES = [DEFAULT_MODEL] + shared_folders("models/stories*")

CHATML = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('system must come first') }}{% endif %}"
          "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
          "{{ {'n': messages | length, 'k': 'é'} | tojson }}")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(DEFAULT_MODEL)


@pytest.mark.parametrize("folder", FOLDERS, ids=os.path.basename)
def test_ids_and_text_equal_transformers(folder: str) -> None:
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    hf.decode(ids, skip_special_tokens=skip), (text, skip)
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("folder", STORIES, ids=os.path.basename)
def test_chat_template_equals_transformers(folder: str) -> None:
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Tom found a red ball."},
                {"role": "assistant", "content": "He played."}, {"role": "user", "content": "é"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def test_template_features_equal_transformers(tmp_path) -> None:
    folder = str(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL, f), folder)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(CHATML)
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == want
    assert want.endswith('<|assistant|>\n{"n": 2, "k": "é"}')
    with pytest.raises(InvalidRequestError, match="system must come first") as info:
        ours.apply_chat_template(messages[::-1])
    assert info.value.param == "messages"


def test_no_chat_template_is_a_clear_error(tmp_path) -> None:
    folder = str(tmp_path)
    shutil.copy(os.path.join(DEFAULT_MODEL, "tokenizer.json"), folder)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_folder_without_tokenizer_json_is_converted(tmp_path) -> None:
    folder = str(tmp_path)
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL, f), folder)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)
    converted, text = load_tokenizer(folder)
    assert text is not None and json.loads(text)["model"]["type"] == "BPE"
    reference = Tokenizer.from_folder(DEFAULT_MODEL)
    for t in TEXTS:
        assert converted.encode(t) == reference.encode(t)
    assert load_tokenizer(DEFAULT_MODEL)[1] is None


def _by_length(tok: Tokenizer, context: list[int], ids: list[int], skip: bool) -> str:
    """The reference: incremental decoding with two decodes per token (prefix and read
    offsets; a piece ending in U+FFFD waits), written out here independently."""
    window, prefix, read, text = list(context), 0, len(context), ""
    for t in ids:
        window.append(t)
        before = tok.backend.decode(window[prefix:read], skip_special_tokens=skip)
        full = tok.backend.decode(window[prefix:], skip_special_tokens=skip)
        if len(full) > len(before) and not full.endswith("\ufffd"):
            text += full[len(before):]
            prefix, read = read, len(window)
    return text


@settings(max_examples=200, deadline=None)
@given(context=st.lists(st.integers(0, 511), max_size=5),
       ids=st.lists(st.one_of(st.integers(0, 511), st.integers(3, 258)), max_size=40),
       skip=st.booleans())
def test_text_stream_equals_the_two_decode_reference(tok: Tokenizer, context: list[int],
                                                     ids: list[int], skip: bool) -> None:
    # NOTE: ids 3..258 are the byte-fallback tokens <0x00>..<0xFF>: random ones make invalid
    # UTF-8, where tokenizers' DecodeStream raises and the stream decodes by length
    while context and tok.decode(context, skip).endswith("\ufffd"):
        context = context[:-1]  # NOTE: the stream primes with complete characters only
    stream = tok.text_stream(context, skip)
    pieces = [stream.step(t) for t in ids]
    assert "".join(p for p in pieces if p) == _by_length(tok, context, ids, skip)
    assert all(p is None or (p and not p.endswith("\ufffd")) for p in pieces)


def test_prompt_cut_inside_a_character_leaks_nothing(tok: Tokenizer) -> None:
    smiley = tok.encode("🙂", add_special_tokens=False)[1:]   # 4 byte tokens after "▁"
    assert len(smiley) == 4
    hi, ok = tok.encode("Hi"), tok.encode(" ok", add_special_tokens=False)
    stream = tok.text_stream(hi + smiley[:2], skip_special_tokens=True)
    pieces = [stream.step(t) for t in ok]
    assert "".join(p for p in pieces if p) == tok.decode(hi + ok, True)[len(tok.decode(hi, True)):]
