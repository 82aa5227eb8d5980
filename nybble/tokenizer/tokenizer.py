"""The model's tokenizer without transformers: the ``tokenizers`` library plus the settings
transformers reads from ``tokenizer_config.json``.

``tokenizer.json`` holds the whole pipeline (normalizer, pre-tokenizer, model, the
post-processor that adds BOS, the decoder), so encoding and decoding through the Rust
tokenizer give transformers' ids and text (tests compare them on every model folder at hand).
``tokenizer_config.json`` adds what the pipeline does not hold: the chat template (or
``chat_template.jinja`` beside it), the special-token strings the template sees, and
``clean_up_tokenization_spaces``. Loading takes milliseconds and imports no torch, so the API
process and the offline engine share it. A folder without ``tokenizer.json`` (a slow
sentencepiece tokenizer only) is converted by transformers on the engine-core side
(:mod:`nybble.tokenizer.hf_tokenizer`), which passes the JSON text here.
"""
from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from nybble.errors import InvalidRequestError
from nybble.model_files import TOKENIZER_FILE, has_tokenizer_file, read_json
from nybble.tokenizer.chat_encode import encode_conversation
from nybble.tokenizer.chat_template import render_chat_template

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")
# transformers' clean_up_tokenization: spaces before punctuation and English contractions
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the
    other 68 bytes, in order, take the characters from U+0100 on (Radford et al. 2019,
    the ``ByteLevel`` pre-tokenizer of ``tokenizers``).
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(0x100 + extra)] = b
            extra += 1
    return chars


def _decoder_types(decoder: Any) -> set[str]:
    """The ``type`` of a tokenizer.json decoder and of the decoders of a ``Sequence``."""
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    for inner in decoder.get("decoders") or ():
        found |= _decoder_types(inner)
    return found


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: str, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else tokenizer_config.json's ``chat_template``
    (a string, or a list of named templates: the one named ``default``)."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Encode, decode, stream-decode and render chat templates for one model.

    Args:
        backend: the Rust tokenizer (``tokenizer.json``).
        config: ``tokenizer_config.json`` (``{}`` if absent), with ``special_tokens_map.json``
            filling special tokens it lacks.
        chat_template: the jinja2 chat template, if the model has one.
    """

    def __init__(self, backend: RustTokenizer, config: dict[str, Any],
                 chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces",
                                                            False))

    @classmethod
    def from_folder(cls, folder: str, tokenizer_json: str | None = None) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder.

        Args:
            tokenizer_json: the pipeline as JSON text, for a folder without
                ``tokenizer.json`` (see :mod:`nybble.tokenizer.hf_tokenizer`).

        Raises:
            FileNotFoundError: no ``tokenizer.json`` and no ``tokenizer_json``.
        """
        if tokenizer_json is not None:
            backend = RustTokenizer.from_str(tokenizer_json)
        elif has_tokenizer_file(folder):
            backend = RustTokenizer.from_file(os.path.join(folder, TOKENIZER_FILE))
        else:
            raise FileNotFoundError(f"tokenizer folder must contain {TOKENIZER_FILE} (or a "
                                    f"tokenizer transformers can convert), got {folder!r}")
        config = read_json(os.path.join(folder, "tokenizer_config.json")) or {}
        for key, value in (read_json(os.path.join(folder, "special_tokens_map.json"))
                           or {}).items():
            config.setdefault(key, value)
        return cls(backend, config, _chat_template(folder, config))

    # ------------------------------------------------------------------ ids <-> text
    @property
    def vocab_size(self) -> int:
        """Token ids of the tokenizer, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    # NOTE: encode and decode go through the batch calls, which release the GIL (the single
    # calls hold it: a 4 MB prompt froze every other thread for 6 s), so a server thread pool
    # that tokenizes leaves the event loop free. Same ids and text, measured faster.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's BOS/EOS when
        ``add_special_tokens``)."""
        batch = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    @functools.cached_property
    def special_token_ids(self) -> dict[str, int]:
        """The text of every special added token (``<s>``, ``<|im_end|>``) -> its id."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()
                if t.special}

    @property
    def special_token_strings(self) -> frozenset[str]:
        """The texts of the special added tokens."""
        return frozenset(self.special_token_ids)

    @functools.cached_property
    def _plain_backend(self) -> RustTokenizer:
        plain = RustTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` read as text only: a special token's string inside it is
        tokenized like any other text (no special tokens added either). A copy of the
        backend does it, so concurrent :meth:`encode` calls are not affected."""
        return list(self._plain_backend.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode_conversation(self, messages: list[dict[str, Any]], rendered: str | None = None,
                            **template_options: Any) -> list[int]:
        """:func:`nybble.tokenizer.chat_encode.encode_conversation`: the chat template's
        ids, special tokens only where the template wrote them."""
        return encode_conversation(self, messages, rendered, **template_options)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (spaces before punctuation cleaned up when the tokenizer config
        asks for it, as transformers does)."""
        text = str(self.backend.decode_batch([list(ids)],
                                             skip_special_tokens=skip_special_tokens)[0])
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token decodes to: the longest token string
        of the vocabulary (``▁`` stands for one space; ``<0x80>``, byte-level characters and
        WordPiece's ``##`` never decode to more characters than they spell)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)),
                   default=1)

    @functools.cached_property
    def _byte_tokens(self) -> tuple[bool, bool]:
        """``(byte_level, byte_fallback)`` of the pipeline (read once from its JSON)."""
        pipeline = json.loads(self.backend.to_str())
        byte_level = "ByteLevel" in _decoder_types(pipeline.get("decoder"))
        model = pipeline.get("model") or {}
        return byte_level, bool(model.get("byte_fallback")) and not byte_level

    def token_bytes(self, token_id: int) -> bytes | None:
        """The exact bytes ``token_id`` adds to the text when they cannot be read from its
        decoded string: a byte-fallback token (``<0x80>``) is that byte, a byte-level BPE
        token the bytes its characters stand for; ``None`` for any other token (its text is
        the decoded string, valid UTF-8)."""
        byte_level, byte_fallback = self._byte_tokens
        token = self.backend.id_to_token(token_id)
        if token is None:
            return None
        if byte_fallback:
            match = _BYTE_TOKEN.fullmatch(token)
            return bytes([int(match.group(1), 16)]) if match else None
        if byte_level:
            chars = _byte_level_chars()
            if all(c in chars for c in token):
                return bytes(chars[c] for c in token)
        return None

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (BOS, EOS, ...: added tokens marked special)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special)

    def text_stream(self, context_ids: Sequence[int], skip_special_tokens: bool,
                    spaces_between_special_tokens: bool = False) -> TextStream:
        """A streaming decoder primed with ``context_ids`` (their text is not returned), so
        the first new token keeps the leading space it has after that context; it decodes as
        :meth:`decode` does unless ``spaces_between_special_tokens`` (see
        :class:`TextStream`)."""
        return TextStream(self, context_ids, skip_special_tokens,
                          spaces_between_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template: str | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation rendered with the model's chat template, or ``chat_template``
        when given (text; the template emits BOS itself, so tokenize it with
        ``add_special_tokens=False``). The options are transformers' (see
        :func:`render_chat_template`).

        Raises:
            InvalidRequestError: no chat template, or the template refused the messages.
        """
        source = chat_template or self.chat_template
        if not source:
            raise InvalidRequestError("this model's tokenizer has no chat template; use "
                                      "/v1/completions or pass chat_template",
                                      param="messages")
        return render_chat_template(source, messages, add_generation_prompt,
                                    self.special_tokens, continue_final_message,
                                    template_kwargs, tools)


class TextStream:
    """Incremental decoding of one token stream: ``tokenizers``' ``DecodeStream``, with the
    window it works on mirrored here.

    Method (vLLM's and ``DecodeStream``'s): the ids from ``prefix`` on are decoded with and
    without the new token; the difference is the new text, emitted only when it does not end
    in U+FFFD (a multi-byte character still incomplete), and then the window moves up.
    ``DecodeStream`` refuses a window whose decoded text no longer starts with its earlier
    decoding (invalid UTF-8 from stray byte-fallback tokens, which a random model emits): that
    token is decoded here the same way, by length, and the stream restarts on the new window.

    ``spaces_between_special_tokens`` (vLLM's option; kept special tokens only): a special
    token and the text on either side of it are joined by one space, as transformers' slow
    tokenizers join their sub-texts, unless that text already has a space there.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int],
                 skip_special_tokens: bool, spaces_between_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens and not skip_special_tokens
        self._after_special = False                   # the last piece was a special token
        self._text_before = bool(list(context_ids))   # some text precedes the next piece
        context = list(context_ids)
        # NOTE: a context that ends inside a character (a prompt cut mid-UTF-8) would put
        # its U+FFFD into the first piece: prime with the complete characters only
        while context and tokenizer.backend.decode(
                context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._window = context             # ids from the prefix on
        self._read = len(self._window)     # ids of the window already turned into text
        self._stream = DecodeStream(ids=self._window, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        """The text ``token_id`` adds; ``None`` while it ends inside a multi-byte UTF-8
        character (split over byte-fallback tokens) or adds nothing."""
        self._window.append(token_id)
        try:
            piece = self._stream.step(self._tok.backend, token_id)
        except Exception:  # noqa: BLE001 -- tokenizers raises a bare Exception (InvalidPrefix)
            piece = self._by_length()
            if piece is not None:
                self._stream = DecodeStream(ids=self._window[self._read:],
                                            skip_special_tokens=self._skip)
        if piece is None:
            return None
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return self._spaced(token_id, str(piece)) if self._spaces else str(piece)

    def _spaced(self, token_id: int, piece: str) -> str:
        """``piece`` with the space that joins it to a neighbouring special token."""
        special = token_id in self._tok.special_ids
        if (special and self._text_before) or self._after_special:
            piece = piece if piece.startswith(" ") else " " + piece
        self._after_special, self._text_before = special, True
        return piece

    def _by_length(self) -> str | None:
        decode = self._tok.backend.decode
        prefix = decode(self._window[:self._read], skip_special_tokens=self._skip)
        full = decode(self._window, skip_special_tokens=self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return str(full[len(prefix):])
