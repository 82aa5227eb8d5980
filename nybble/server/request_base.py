"""The base of every request model: the rules that make the OpenAPI schema exact.

Schema-conformance fuzzing checks the server against ``/openapi.json``, so what the schema
allows must be what the server accepts:

- types are strict (OpenAI's): ``"n": 1.0``, ``"n": "1"`` or ``"stream": 1`` are 400s, not
  coerced; a float field takes an integer;
- an optional field sent as JSON ``null`` is the same as the field left out (its default),
  except the fields a model names in ``NULL_IS_VALUE`` (completions' ``max_tokens: null``
  is vLLM's "the rest of the context", left out it is 16); the schema marks every optional
  field nullable;
- every string is valid Unicode: a lone UTF-16 surrogate (``"\\ud800"`` in the JSON) is a 400
  naming the field, before anything tokenizes or echoes it.
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from nybble.errors import InvalidRequestError


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """JSON-schema hook: every property that is not required also accepts ``null``."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or _allows_null(prop):
            continue
        keep = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **keep}


def _allows_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(_allows_null(p) for p in prop.get("anyOf", ()))


def _first_surrogate(value: Any) -> str | None:
    """A description of the first lone surrogate in ``value`` (strings inside lists and
    dicts, keys included), or ``None``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"U+{ord(value[e.start]):04X} at character {e.start}"
        return None
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        # NOTE: no field takes a list that mixes numbers and strings (the schema refuses
        # one), so a list of numbers (a token-id prompt) is not walked element by element
        if value and type(value[0]) in (int, float):
            return None
        if value and isinstance(value[0], str):
            try:  # NOTE: one C-speed check for a list of strings, the common case
                "".join(value).encode("utf-8")
                return None
            except (TypeError, UnicodeEncodeError):
                pass
        items = value
    else:
        return None
    for item in items:
        found = _first_surrogate(item)
        if found is not None:
            return found
    return None


class RequestModel(BaseModel):
    """Strict types; ``null`` = omitted (but for the fields in ``NULL_IS_VALUE``); every
    optional field nullable in the schema."""

    model_config = ConfigDict(extra="ignore", strict=True,
                              json_schema_extra=_nullable_optionals)  # type: ignore[typeddict-item]
    NULL_IS_VALUE: ClassVar[frozenset[str]] = frozenset()
    """Fields whose ``null`` is a value of its own, not the default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.NULL_IS_VALUE}
        return data


class RequestBody(RequestModel):
    """A whole request body: its strings are checked for lone surrogates first.

    NOTE: the :class:`InvalidRequestError` (a ``ValueError``) carries the top-level field as
    its ``param``, which the 400 handler reports.
    """

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                found = _first_surrogate(key) or _first_surrogate(value)
                if found is not None:
                    name = key if _first_surrogate(key) is None else "body"
                    raise InvalidRequestError(
                        f"{name} must be valid Unicode text, got a lone surrogate {found}",
                        param=name)
        return data


