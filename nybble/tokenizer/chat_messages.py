"""OpenAI chat messages as chat-template input, by transformers' conventions.

OpenAI sends an assistant message's tool calls with ``function.arguments`` as JSON *text*;
Hugging Face chat templates expect the arguments as a mapping (they write
``tool_call.arguments | tojson``, and transformers' chat-template documentation, "Tool use",
passes ``{"type": "function", "function": {"name": ..., "arguments": {...}}}``), so the text
is parsed here, as vLLM does before rendering. Tool results (``role: "tool"``) keep their
``tool_call_id`` and ``name``; the tools themselves are passed to the template as the
``tools`` variable, as given (JSON-schema function specs). Shared by the server and offline
``LLM.chat``, so both render a conversation to the same prompt.
"""
from __future__ import annotations

import json
from typing import Any

from nybble.errors import InvalidRequestError


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` ready for a chat template.

    Args:
        messages: OpenAI chat messages (``role``, ``content`` as text or text parts,
            ``tool_calls``, ``tool_call_id``, ``name``).

    Returns:
        The messages with ``content`` as one string (``""`` for ``null``) and every tool
        call's ``function.arguments`` parsed into a dict.

    Raises:
        InvalidRequestError: a tool call's arguments that are not a JSON object
            (``param="messages"``).
    """
    out = []
    for i, m in enumerate(messages):
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        msg["content"] = content if content is not None else ""
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_call(i, c) for c in msg["tool_calls"]]
        out.append(msg)
    return out


def _call(index: int, call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(f"messages[{index}].tool_calls: function.arguments must "
                                      f"be JSON text, got {arguments[:100]!r} ({e})",
                                      param="messages") from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"messages[{index}].tool_calls: function.arguments must be "
                                  f"a JSON object, got {arguments!r}"[:300], param="messages")
    function["arguments"] = arguments
    return {**call, "function": function}
