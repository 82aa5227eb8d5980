"""Logprob token strings, bytes and text offsets: the bytes are each token's own UTF-8 bytes
(a byte-fallback token is its one byte), they add up to the text, and every offset indexes the
returned text, also for a character split over several tokens."""
from __future__ import annotations

import os

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from nybble.config import DEFAULT_MODEL
from nybble.tokenizer.tokenizer import Tokenizer, _byte_level_chars
from nybble.server.logprobs import SampleDecoder, chat_logprobs, completion_logprobs
from tests.conftest import SHARED

BYTE_LEVEL_FOLDER = os.path.join(SHARED, "fixtures", "quant", "tiny-llama-fp32")
TEXT = " Tom said 日本 🙂, é ok"
"""Characters of 2, 3 and 4 UTF-8 bytes: the bundled 512-token vocabulary spells them with
byte-fallback tokens."""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(DEFAULT_MODEL)


def _split(tok: Tokenizer, text: str) -> tuple[list[int], list[int], str]:
    """``(context, ids, expected)``: "Once" + text tokenized, cut after "Once"; the text the
    ids add after it (decoded independently, by the whole-sequence decoder)."""
    full = tok.encode("Once" + text)
    context = tok.encode("Once")
    assert full[:len(context)] == context
    expected = tok.decode(full, skip_special_tokens=True)[len(tok.decode(context, True)):]
    return context, full[len(context):], expected


def test_byte_fallback_tokens_are_their_byte(tok: Tokenizer) -> None:
    for b in (0x80, 0xE6, 0xF0):
        token_id = tok.backend.token_to_id(f"<0x{b:02X}>")
        assert token_id is not None
        assert tok.token_bytes(token_id) == bytes([b])
    assert tok.token_bytes(tok.backend.token_to_id("▁the")) is None   # decoded text instead


def test_pieces_add_up_to_the_text_and_offsets_index_it(tok: Tokenizer) -> None:
    context, ids, expected = _split(tok, TEXT)
    byte_ids = {i for i in ids if tok.token_bytes(i) is not None}
    assert len(byte_ids) >= 3, "the text should need byte-fallback tokens"
    pieces, _ = SampleDecoder(tok, context, text_offset=7).pieces(ids)
    assert b"".join(p.raw for p in pieces) == expected.encode()
    assert "".join(p.token for p in pieces if not p.token.startswith("bytes:")) == expected
    for i, p in zip(ids, pieces, strict=True):
        at = p.offset - 7
        if p.token.startswith("bytes:"):   # ends inside a character: points at that character
            assert i in byte_ids and p.raw == tok.token_bytes(i)
            assert p.token == "bytes:" + "".join(f"\\x{b:02x}" for b in p.raw)
            assert p.raw in expected[at].encode()
        else:
            assert expected[at:at + len(p.token)] == p.token
    partial = [p for p in pieces if p.token.startswith("bytes:")]
    assert [p.raw for p in partial][:2] == [b"\xe6", b"\x97"]   # 日 = e6 97 a5


def test_decoder_continues_across_calls(tok: Tokenizer) -> None:
    context, ids, _ = _split(tok, TEXT)
    whole, _ = SampleDecoder(tok, context).pieces(ids)
    decoder = SampleDecoder(tok, context)
    parts = [p for cut in (slice(0, 5), slice(5, 9), slice(9, None))
             for p in decoder.pieces(ids[cut])[0]]
    assert parts == whole


def test_chat_and_completion_formats(tok: Tokenizer) -> None:
    context, ids, expected = _split(tok, TEXT)
    other = tok.backend.token_to_id("<0x80>")
    entries = [{t: -0.5, other: -1.5} if t != other else {t: -0.5} for t in ids]
    chat = chat_logprobs(SampleDecoder(tok, context), ids, entries, 2).content
    assert chat is not None
    assert b"".join(bytes(c.bytes or []) for c in chat) == expected.encode()
    for c in chat:
        alt = {t.token: t for t in c.top_logprobs}
        assert alt[c.token].bytes == c.bytes and alt[c.token].logprob == -0.5
        assert any(t.bytes == [0x80] for t in c.top_logprobs)   # <0x80> alone: its byte
    comp = completion_logprobs(SampleDecoder(tok, context, 4), ids, entries, 2)
    assert comp.tokens == [c.token for c in chat]
    assert comp.text_offset[0] == 4 and comp.text_offset == sorted(comp.text_offset)
    assert comp.token_logprobs == [-0.5] * len(ids)


def test_byte_level_alphabet_matches_tokenizers() -> None:
    chars = _byte_level_chars()
    assert sorted(chars.values()) == list(range(256))
    assert set(chars) == set(ByteLevel.alphabet())
    for text in ["Hello, world!", "é 日本 🙂", "\t\n\x00\x7f", "".join(map(chr, range(32, 1200)))]:
        (mapped, _), = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
        assert bytes(chars[c] for c in mapped) == text.encode()


@pytest.mark.skipif(not os.path.isdir(BYTE_LEVEL_FOLDER),
                    reason=f"needs the byte-level tokenizer fixture at {BYTE_LEVEL_FOLDER}")
def test_byte_level_tokens_add_up_to_the_text() -> None:
    tok = Tokenizer.from_folder(BYTE_LEVEL_FOLDER)
    context, ids, expected = _split(tok, TEXT)
    assert all(tok.token_bytes(i) is not None for i in ids)
    assert b"".join(tok.token_bytes(i) or b"" for i in ids) == expected.encode()
    pieces, _ = SampleDecoder(tok, context).pieces(ids)
    assert "".join(p.token for p in pieces if not p.token.startswith("bytes:")) == expected


LEADING = ["\nHello there", " lead space", "\n\n日本 ok", "Once\n upon", "\t🙂 é"]
"""Prompts that start with a newline, a space, a tab or a multi-byte character: SentencePiece
spells their start with a lone word-start token that the decoded text drops."""


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("text", LEADING)
def test_leading_whitespace_pieces_concatenate_to_the_text(tok: Tokenizer, text: str) -> None:
    """An echoed prompt from its BOS (the server's echo path): a token that adds no bytes is
    ``""``, never a ``bytes:`` form; ``bytes:`` only where the bytes end inside a character."""
    ids = tok.encode(text)
    bos = frozenset({ids[0]})
    pieces, _ = SampleDecoder(tok, [], hidden=bos).pieces(ids)
    shown = [p for i, p in zip(ids, pieces, strict=True) if i not in bos]
    assert "".join(p.token for p in shown if not p.token.startswith("bytes:")) \
        == tok.decode(ids, skip_special_tokens=True)
    assert b"".join(p.raw for p in shown) == text.encode()
    for p in shown:
        assert p.token != "bytes:"
        if p.token.startswith("bytes:"):
            assert not _is_utf8(p.raw)
    if not text[0].isalnum():
        assert any(p.token == "" and p.raw == b"" for p in shown)   # the lone word start


@pytest.mark.parametrize("text", LEADING)
def test_completion_pieces_after_a_prompt_concatenate_to_the_text(tok: Tokenizer,
                                                                  text: str) -> None:
    context = tok.encode("Once")
    ids = tok.backend.encode(text, add_special_tokens=False).ids
    expected = tok.decode(context + ids, skip_special_tokens=True)[
        len(tok.decode(context, skip_special_tokens=True)):]
    pieces, _ = SampleDecoder(tok, context).pieces(ids)
    assert "".join(p.token for p in pieces if not p.token.startswith("bytes:")) == expected
    assert all(p.token != "bytes:" for p in pieces)
