"""The request fields that become logit shaping and structured output in
:class:`SamplingParams`: OpenAI's ``logit_bias`` (string keys) and ``response_format``, vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` extras.

Only shapes are converted here; the request gate checks every value
(:mod:`nybble.runtime.frontend.shaping_checks`).
"""
from __future__ import annotations

from nybble.errors import InvalidRequestError
from nybble.sampling_params import GuidedDecodingParams
from nybble.server.protocol import _SamplingFields


def logit_bias(req: _SamplingFields) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids (OpenAI sends the ids as JSON object keys).

    Raises:
        InvalidRequestError: a key that is not an integer.
    """
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in req.logit_bias.items():
        try:
            out[int(key)] = bias
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers), got "
                                      f"{key!r}", param="logit_bias") from None
    return out


def guided_decoding(req: _SamplingFields) -> GuidedDecodingParams | None:
    """The request's one structured-output constraint, or ``None``.

    Raises:
        InvalidRequestError: more than one of ``response_format`` (JSON), ``guided_json``,
            ``guided_regex`` and ``guided_choice``.
    """
    found: list[tuple[str, GuidedDecodingParams]] = []
    fmt = req.response_format or {}
    if fmt.get("type") == "json_object":
        found.append(("response_format", GuidedDecodingParams(json_object=True)))
    elif fmt.get("type") == "json_schema":
        found.append(("response_format",
                      GuidedDecodingParams(json=fmt["json_schema"]["schema"])))
    if req.guided_json is not None:
        found.append(("guided_json", GuidedDecodingParams(json=req.guided_json)))
    if req.guided_regex is not None:
        found.append(("guided_regex", GuidedDecodingParams(regex=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", GuidedDecodingParams(choice=req.guided_choice)))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise InvalidRequestError(f"at most one structured-output constraint may be given, "
                                  f"got {names}", param=names[1])
    return found[0][1] if found else None
