"""A conversation rendered with its chat template, as token ids, where only the template's
own markers are special tokens.

Text a user types inside a message's ``content`` that spells a special token (``</s>``,
``<|im_end|>``) would otherwise become that control token when the rendered text is
tokenized, letting a message end its own turn or fake another role (the prompt injection
lmdeploy guards against). Method:

1. conversations whose contents spell no special token are tokenized as they always were
   (the rendered text, special tokens recognised): byte-identical ids;
2. otherwise each special-token string inside a content is replaced by a private-use
   character that occurs nowhere in the conversation, and the conversation is rendered again.
   Special-token strings left in that text are the template's own. The text is cut at them;
   each cut piece, the marks turned back into the strings they stand for, is tokenized with
   special-token matching off, and the template's markers become their ids. This is the
   tokenizer's own rule (it tokenizes the text between special tokens piece by piece), so
   only the pieces that held a spelled special token can change (and, for a tokenizer that
   adds its word-start prefix at the start of the whole text only, the start of a piece).
"""
from __future__ import annotations

import re
from typing import Any, Protocol

PRIVATE_USE = range(0xE000, 0xF900)
"""Unicode's private-use area: where the marks come from."""


class ChatTokenizer(Protocol):
    """What :func:`encode_conversation` needs of a tokenizer
    (:class:`nybble.tokenizer.tokenizer.Tokenizer` has it; a Protocol, so this module does
    not import the tokenizer that imports it)."""

    @property
    def special_token_ids(self) -> dict[str, int]:
        """The text of every special added token -> its id."""

    @property
    def special_token_strings(self) -> frozenset[str]:
        """The texts of the special added tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, special-token strings recognised."""

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` read as text only (special-token strings too)."""

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template: str | None = None,
                            template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation rendered with the chat template."""


def _contents(messages: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in messages if isinstance(m.get("content"), str)]


def encode_conversation(tok: ChatTokenizer, messages: list[dict[str, Any]],
                        rendered: str | None = None, **template_options: Any) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template; special tokens only where
    the template wrote them (see the module docstring).

    Args:
        tok: the model's tokenizer.
        messages: chat messages ready for the template (``content`` strings,
            :func:`nybble.tokenizer.chat_messages.template_messages`).
        rendered: the messages already rendered with these options, if at hand.
        template_options: :meth:`Tokenizer.apply_chat_template`'s keyword options.

    Returns:
        The ids, BOS included when the template emits it (no special tokens are added).

    Raises:
        InvalidRequestError: no chat template, or the template refused the messages.
    """
    text = rendered if rendered is not None else \
        tok.apply_chat_template(messages, **template_options)
    contents = _contents(messages)
    spelled = sorted({s for s in tok.special_token_strings if any(s in c for c in contents)},
                     key=len, reverse=True)
    if not spelled:
        return tok.encode(text, add_special_tokens=False)
    taken = set(text).union(*map(set, contents))
    free = (chr(c) for c in PRIVATE_USE if chr(c) not in taken)
    marks = {s: next(free) for s in spelled}
    pattern = re.compile("|".join(map(re.escape, spelled)))
    marked = [{**m, "content": pattern.sub(lambda hit: marks[hit.group(0)], m["content"])}
              if isinstance(m.get("content"), str) else m for m in messages]
    rendered = tok.apply_chat_template(marked, **template_options)
    unmark = {v: k for k, v in marks.items()}
    own = sorted(tok.special_token_strings, key=len, reverse=True)
    ids: list[int] = []
    for i, piece in enumerate(re.split(f"({'|'.join(map(re.escape, own))})", rendered)):
        if i % 2:                                   # a marker the template wrote
            ids.append(tok.special_token_ids[piece])
        elif piece:
            plain = "".join(unmark.get(ch, ch) for ch in piece)
            ids.extend(tok.encode_plain(plain))
    return ids
