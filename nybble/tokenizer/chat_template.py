"""Render a Hugging Face chat template with jinja2, the way transformers does, without it.

Hugging Face chat templates are jinja2 programs from the model folder, rendered in a sandbox
(``ImmutableSandboxedEnvironment``) with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, the globals
``raise_exception`` and ``strftime_now``, and the ``{% generation %}`` block tag (a no-op
when rendering). The template sees ``messages``, ``add_generation_prompt`` and the tokenizer's
special tokens (``bos_token``, ``eos_token``, ...). Source: transformers' documentation of
chat templates ("Templates for chat models") and its ``apply_chat_template``.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nybble.errors import InvalidRequestError


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training masks;
    rendering keeps the body as it is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _keep(caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source text).

    Raises:
        jinja2.TemplateSyntaxError: ``source`` is not a valid template.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to the final message with ``continue_final_message``: where it lands in the
rendered text is where that message's text ends (the end-of-turn after it is cut off)."""


def render_chat_template(source: str, messages: list[dict[str, Any]],
                         add_generation_prompt: bool,
                         special_tokens: dict[str, str | None],
                         continue_final_message: bool = False,
                         template_kwargs: dict[str, Any] | None = None,
                         tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation as the prompt text the model was trained on.

    Args:
        source: the jinja2 template.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        add_generation_prompt: end with the header of an assistant turn.
        special_tokens: ``bos_token``, ``eos_token``, ... as the template names them.
        continue_final_message: leave the final message open (assistant prefill): the text
            ends where that message's content ends, without the end-of-turn the template
            writes after it (transformers' rule: a marker appended to the content locates
            that end; trailing spaces the template trimmed stay trimmed).
        template_kwargs: extra variables for the template (``chat_template_kwargs``); they
            override the special tokens of the same name.
        tools: function specs (``[{"type": "function", "function": {...}}]``), the
            template's ``tools`` variable (``None`` without tools, as transformers passes).

    Raises:
        InvalidRequestError: the template refused the conversation (``raise_exception``,
            e.g. "roles must alternate") or failed to render it (any exception the template
            raises on these messages: an undefined field, a type error...), or the final
            message cannot be continued; ``param`` is ``messages``.
    """
    if continue_final_message:
        if add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt must "
                                      "not both be true", param="continue_final_message")
        messages = [*messages[:-1], {**messages[-1],
                                     "content": messages[-1]["content"] + _CONTINUE_TAG}]
    try:
        template = compile_template(source)
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{**special_tokens, "tools": tools, **(template_kwargs or {})})
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"messages were refused by the chat template: {e}",
                                  param="messages") from None
    except Exception as e:  # noqa: BLE001 -- a template is a program run on user input
        raise InvalidRequestError(f"messages could not be rendered by the chat template: "
                                  f"{type(e).__name__}: {e}", param="messages") from None
    return _cut_at_tag(text) if continue_final_message else text


def _cut_at_tag(text: str) -> str:
    """The rendered text up to the end of the final message (see ``continue_final_message``).

    Raises:
        InvalidRequestError: the template dropped the final message's text.
    """
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise InvalidRequestError("continue_final_message needs the final message's text in "
                                  "the rendered prompt, but the chat template dropped it",
                                  param="messages")
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()    # NOTE: the template trimmed the message's trailing space
