"""The request gate's checks of the logit-shaping and structured-output parameters.

Torch-free (the API process runs the gate). Ranges follow OpenAI's API reference
(``logit_bias`` in ``[-100, 100]``, presence and frequency penalties in ``[-2, 2]``) and vLLM
(``repetition_penalty > 0``, ``min_tokens <= max_tokens``, ``bad_words``,
``allowed_token_ids``, one structured-output constraint per request). A JSON schema is checked
against its JSON Schema meta-schema (``jsonschema``) and a regex by Python's ``re`` here, so a
bad one is a 400 before anything is queued; the grammar itself is compiled in the engine core,
where the grammar engine and the tokenizer's vocabulary live.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence

from nybble.errors import InvalidRequestError
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import GuidedDecodingParams, SamplingParams

LOGIT_BIAS_LIMIT = 100.0
"""``|bias|`` allowed per token (OpenAI)."""
OPENAI_PENALTY_LIMIT = 2.0
"""``|presence_penalty|`` and ``|frequency_penalty|`` allowed (OpenAI)."""


def _fail(name: str, allowed: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {allowed}, got {value!r}", param=name)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _token_ids(ids: object, name: str, vocab: int, allow_empty: bool) -> None:
    if not isinstance(ids, (list, tuple)) or (not ids and not allow_empty) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise _fail(name, f"a {'' if allow_empty else 'non-empty '}list of token ids in "
                    f"[0, {vocab})", ids)


def check_min_tokens(min_tokens: object, max_tokens: int | None,
                     max_tokens_name: str = "max_tokens") -> None:
    """The ``min_tokens`` rule: an integer in ``[0, max_tokens]`` (``max_tokens`` ``None``:
    not resolved yet, so only ``>= 0``; the gate checks again once it is).

    Args:
        max_tokens_name: the API's name of ``max_tokens``, for the message.

    Raises:
        InvalidRequestError: naming ``min_tokens``.
    """
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0 or \
            (max_tokens is not None and min_tokens > max_tokens):
        raise _fail("min_tokens", "an integer >= 0" if max_tokens is None else
                    f"an integer in [0, {max_tokens_name} ({max_tokens})]", min_tokens)


def check_shaping(p: SamplingParams, vocab_size: int,
                  max_tokens_name: str = "max_tokens") -> None:
    """Check ``logit_bias``, ``min_tokens`` (:func:`check_min_tokens`), the penalties,
    ``bad_words`` and ``allowed_token_ids`` (``max_tokens`` is checked before;
    ``max_tokens_name``: its name in the API, for the messages).

    Raises:
        InvalidRequestError: naming the first parameter out of range.
    """
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise _fail("logit_bias", "a map of token id to bias", p.logit_bias)
        bad_ids = [t for t in p.logit_bias if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < vocab_size]
        if bad_ids:
            raise _fail("logit_bias", f"keyed by token ids in [0, {vocab_size})", bad_ids[:5])
        bad = [v for v in p.logit_bias.values()
               if not _finite(v) or abs(v) > LOGIT_BIAS_LIMIT]
        if bad:
            raise _fail("logit_bias", f"biases in [-{LOGIT_BIAS_LIMIT:g}, "
                        f"{LOGIT_BIAS_LIMIT:g}]", bad[0])
    check_min_tokens(p.min_tokens, p.max_tokens, max_tokens_name)
    if not _finite(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise _fail("repetition_penalty", "a finite number > 0 (1: none)",
                    p.repetition_penalty)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _finite(value) or abs(value) > OPENAI_PENALTY_LIMIT:
            raise _fail(name, f"in [-{OPENAI_PENALTY_LIMIT:g}, {OPENAI_PENALTY_LIMIT:g}]",
                        value)
    if p.bad_words is not None and (not isinstance(p.bad_words, list) or any(
            not isinstance(w, str) or not w.strip() for w in p.bad_words)):
        raise _fail("bad_words", "a list of non-blank strings", p.bad_words)
    if p.allowed_token_ids is not None:
        _token_ids(p.allowed_token_ids, "allowed_token_ids", vocab_size, allow_empty=False)


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences ``words`` ban: each word as is and with one leading space (the
    form it takes after another word), without special tokens; the spaced form is kept only
    when it differs from the plain one and has as many tokens (vLLM's rule: a longer form
    would ban more than the word)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def check_guided(g: GuidedDecodingParams) -> GuidedDecodingParams:
    """Check a structured-output constraint; a JSON schema given as a dict becomes JSON text.

    Raises:
        InvalidRequestError: not exactly one constraint, a schema that is not valid JSON
            Schema, a regex Python cannot compile, or an empty ``choice``.
    """
    import jsonschema

    kinds = g.kind()
    if len(kinds) != 1:
        raise _fail("guided_decoding", "exactly one of json, regex, choice or json_object",
                    kinds)
    if g.json is not None:
        schema = g.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise _fail("response_format", "a JSON schema", f"invalid JSON ({e})") from e
        if not isinstance(schema, (dict, bool)):
            raise _fail("response_format", "a JSON schema (an object)", schema)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise _fail("response_format", "a valid JSON schema",
                        f"{e.message} at {list(e.path)}") from e
        return dataclasses.replace(g, json=json.dumps(schema))
    if g.regex is not None:
        try:
            re.compile(g.regex)
        except (re.error, TypeError) as e:
            raise _fail("guided_regex", "a valid regular expression", f"{g.regex!r} ({e})") \
                from e
    if g.choice is not None and (not isinstance(g.choice, list) or not g.choice or any(
            not isinstance(c, str) or not c for c in g.choice)):
        raise _fail("guided_choice", "a non-empty list of non-empty strings", g.choice)
    return g
