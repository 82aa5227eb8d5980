"""Incremental detokenization: streamed pieces add up to the text transformers decodes."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from nybble.config import DEFAULT_MODEL
from nybble.tokenizer.detokenizer import IncrementalDetokenizer
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(DEFAULT_MODEL)


def _stream(tok, prompt: str, text: str, stop: list[str] | None = None,
            skip_special_tokens: bool = True, extra: list[int] | None = None,
            **options: bool) -> tuple[list[str], str]:
    prompt_ids = tok.encode(prompt)
    out_ids = tok.encode(prompt + text)[len(prompt_ids):] + (extra or [])
    d = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(
        stop=stop, skip_special_tokens=skip_special_tokens, **options))
    pieces = []
    for t in out_ids:
        d.add_token(t)
        pieces.append(d.take_delta(finished=False))
        if d.stop_reason:
            break
    pieces.append(d.take_delta(finished=True))
    return pieces, d.output_text


def test_concatenated_pieces_equal_decoded_text(tok) -> None:
    pieces, text = _stream(tok, "Once upon a time", ", there was a little  girl.\nShe ran.")
    assert "".join(pieces) == text == ", there was a little  girl.\nShe ran."


def test_leading_space_kept(tok) -> None:
    pieces, text = _stream(tok, "Once upon", " a time")
    assert text == " a time"
    assert pieces[0].startswith(" ")


def test_multibyte_character_never_split(tok) -> None:
    # The 512-piece vocabulary has no emoji: they become 4 byte-fallback tokens.
    pieces, text = _stream(tok, "Hi", " 🙂 and é and 日本")
    assert text == " 🙂 and é and 日本"
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok) -> None:
    pieces, text = _stream(tok, "Once", " upon a time there was a dog", stop=["time there"])
    assert text == " upon a "
    assert "".join(pieces) == text
    assert not any("tim" in p for p in pieces)


def test_earliest_stop_string_wins(tok) -> None:
    _, text = _stream(tok, "Once", " upon a time there was a dog", stop=["dog", "a t"])
    assert text == " upon "


def test_pieces_equal_transformers_decode(tok) -> None:
    hf = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    prompt_ids = tok.encode("Once upon a time")
    out_ids = tok.encode("Once upon a time, Lily said: \"é 🙂!\"  ok.\n")[len(prompt_ids):]
    _, text = _stream(tok, "Once upon a time", ", Lily said: \"é 🙂!\"  ok.\n")
    full = hf.decode(prompt_ids + out_ids, skip_special_tokens=True)
    assert full == hf.decode(prompt_ids, skip_special_tokens=True) + text


@pytest.mark.parametrize("skip, spaces, want", [
    (True, True, " upon the dog"), (True, False, " upon the dog"),
    (False, False, " upon</s><s> the dog"),
    # transformers' slow-tokenizer rule: the sub-texts around special tokens joined by " "
    (False, True, " upon </s> <s> the dog")])
def test_skip_special_tokens(tok, skip: bool, spaces: bool, want: str) -> None:
    eos = 2  # "</s>" in the bundled vocabulary
    base, full = tok.encode("Once upon"), tok.encode("Once upon the dog")
    assert full[:len(base)] == base
    extra = [eos, 1, *full[len(base):]]      # "▁the ▁dog"
    pieces, text = _stream(tok, "Once", " upon", skip_special_tokens=skip, extra=extra,
                           spaces_between_special_tokens=spaces)
    assert text == want
    assert "".join(pieces) == text


def test_include_stop_str_in_output(tok) -> None:
    pieces, text = _stream(tok, "Once", " upon a time there was a dog", stop=["time there"],
                           include_stop_str_in_output=True)
    assert text == " upon a time there"
    assert "".join(pieces) == text
