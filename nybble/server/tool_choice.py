"""What a chat request's ``tools`` and ``tool_choice`` mean: the checks, the grammar, the
parser.

- ``none`` (the default without tools): the tools go to the chat template only; the output
  is content.
- ``auto`` (the default with tools): the model decides; its output is parsed by the server's
  ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``, vLLM's flags; a 400 naming
  them otherwise).
- a named function, or ``required``: generated under the structured-output grammar (xgrammar,
  in the engine core), so every call validates against its ``parameters`` schema: the named
  function's arguments object, or a JSON array of ``{"name", "parameters"}`` calls (exactly
  one unless ``parallel_tool_calls``), vLLM's shape.

Source: OpenAI's chat completions reference (``tools``, ``tool_choice``,
``parallel_tool_calls``) and vLLM's tool-calling documentation.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nybble.errors import InvalidRequestError
from nybble.sampling_params import GuidedDecodingParams
from nybble.server.tool_parsers import TOOL_PARSERS, ToolParser
from nybble.server.tool_parsers.forced import NamedCallParser, RequiredCallsParser

if TYPE_CHECKING:
    from nybble.server.config import ServerConfig
    from nybble.server.protocol import ChatCompletionRequest

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function name: letters, digits, ``_`` and ``-``, at most 64."""

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The schema of a function declared without ``parameters`` (OpenAI: no arguments)."""


def _bad(message: str, param: str = "tools") -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """``tools`` checked: each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`` with a valid, unique name and a ``parameters`` JSON schema; ``None``
    when there are none.

    Raises:
        InvalidRequestError: ``param="tools"``, naming the entry and what is wrong.
    """
    if not tools:
        return None
    import jsonschema   # NOTE: lazily, as the request gate does

    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object {{\"type\": \"function\", \"function\": "
                       f"{{...}}}}, got {tool!r}"[:300])
        if tool.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function must be an object with a 'name', got {fn!r}"[:300])
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise _bad(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                       f"got {name!r}"[:300])
        if name in names:
            raise _bad(f"{where}.function.name {name!r} is declared twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise _bad(f"{where}.function.parameters must be a JSON schema object, got "
                           f"{params!r}"[:300])
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as e:
                raise _bad(f"{where}.function.parameters must be a valid JSON schema: "
                           f"{e.message}"[:500]) from None
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_PARAMETERS


@dataclass
class ToolPlan:
    """How one chat request calls tools.

    Attributes:
        mode: ``none``, ``auto``, ``required`` or ``named``.
        tools: the checked tools (for the template), or ``None``.
        guided: the grammar of ``required`` and ``named``, else ``None``.
        parser: makes one sample's parser (``None``: the output is content).
    """

    mode: str
    tools: list[dict[str, Any]] | None
    guided: GuidedDecodingParams | None = None
    parser: Callable[[], ToolParser] | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser reads special tokens (decode with ``skip_special_tokens`` off)."""
        return self.parser is not None and self.parser().keeps_special_tokens


def plan_tools(req: ChatCompletionRequest, config: ServerConfig) -> ToolPlan:
    """The request's tool plan (see the module's docstring).

    Raises:
        InvalidRequestError: bad ``tools`` (``param="tools"``); a ``tool_choice`` that is not
            one of the four forms, names a function not in ``tools``, needs tools that are
            not there, or is ``auto`` on a server started without
            ``--enable-auto-tool-choice --tool-call-parser NAME``; a named or required
            choice together with another structured-output constraint.
    """
    tools = check_tools(req.tools)
    choice = req.tool_choice
    given = choice is not None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        return _named(req, tools, choice)
    if choice not in ("none", "auto", "required"):
        raise _bad(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": "
                   f"\"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}",
                   "tool_choice")
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan("none", tools)
    if not tools:
        raise _bad(f"tool_choice {choice!r} needs tools, got none", "tool_choice")
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise _bad("tool_choice 'auto' (the default when tools are given) needs a server "
                       "started with --enable-auto-tool-choice --tool-call-parser NAME (one "
                       f"of {sorted(TOOL_PARSERS)}); pass tool_choice 'none', 'required' or "
                       "a named function instead", "tool_choice" if given else "tools")
        return ToolPlan("auto", tools, parser=TOOL_PARSERS[config.tool_call_parser])
    _no_other_constraint(req)
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return ToolPlan("required", tools, GuidedDecodingParams(json=schema), RequiredCallsParser)


def _named(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
           choice: dict[str, Any]) -> ToolPlan:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise _bad(f"tool_choice must be {{\"type\": \"function\", \"function\": {{\"name\": "
                   f"...}}}} to name a function, got {choice!r}"[:300], "tool_choice")
    found = [t for t in tools or () if t["function"]["name"] == name]
    if not found:
        have = [t["function"]["name"] for t in tools or ()]
        raise _bad(f"tool_choice names function {name!r}, which is not in tools "
                   f"(declared: {have})", "tool_choice")
    _no_other_constraint(req)
    return ToolPlan("named", tools, GuidedDecodingParams(json=_parameters(found[0])),
                    lambda: NamedCallParser(name))


def _no_other_constraint(req: ChatCompletionRequest) -> None:
    fmt = (req.response_format or {}).get("type", "text")
    others = [n for n, v in (("response_format", fmt != "text"),
                             ("guided_json", req.guided_json is not None),
                             ("guided_regex", req.guided_regex is not None),
                             ("guided_choice", req.guided_choice is not None)) if v]
    if others:
        raise _bad(f"a named or 'required' tool_choice generates under its own grammar and "
                   f"cannot be combined with {others[0]}", "tool_choice")


def remap_grammar_error(plan: ToolPlan, err: InvalidRequestError) -> InvalidRequestError:
    """A grammar the engine core refused, named by the parameter that made it (``tools``,
    when the grammar came from the tool choice), else ``err`` itself."""
    if plan.guided is None or err.param != "response_format":
        return err
    return _bad(f"tools: a function's parameters schema cannot be compiled for tool_choice "
                f"{plan.mode!r}: {err}")
