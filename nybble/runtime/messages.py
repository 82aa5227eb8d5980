"""The typed messages between the engine's three parts (vLLM V1's split).

::

    prompt, SamplingParams ──> InputProcessor (the request gate) ──> EngineCoreRequest
    EngineCoreRequest ──> EngineCore (scheduler + model runner) ──> EngineCoreOutputs per step
    EngineCoreOutputs ──> OutputProcessor (detokenizer, stop strings) ──> RequestOutput

The engine core deals in token ids only: no text, no tokenizer. Every field here is a plain
value or a numpy array, so a message can cross a process boundary (msgpack) unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nybble.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A request the gate has validated and completed; the core trusts every field.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt's ids (non-empty, all in the vocabulary).
        params: the sampling parameters, with ``max_tokens`` resolved to an int.
        stop_token_ids: ids that end a sequence in the scheduler: the user's
            ``stop_token_ids`` plus the model's EOS ids unless ``ignore_eos``.
        arrival_time: ``time.monotonic()`` when the request arrived (seconds).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int]
    arrival_time: float

    @property
    def max_tokens(self) -> int:
        """The resolved generation budget (tokens)."""
        assert self.params.max_tokens is not None, "the gate resolves max_tokens"
        return self.params.max_tokens


@dataclass(slots=True)
class EngineCoreOutputs:
    """What one core step produced, column by column: row ``r`` is one sampled sequence.

    Attributes:
        request_ids: ``S`` request ids.
        sample_indices: ``S`` sample indices in ``[0, n)``.
        token_ids: ``int32[S]`` the token each sequence sampled.
        finish_reasons: ``int8[S]`` ``FinishReason`` codes (0: still running, 1: a stop
            token id, 2: length).
        logprobs: ``float32[S]`` log-probability of each sampled token, or ``None`` when no
            row asked for logprobs.
        top_token_ids, top_logprobs: ``[S, k]`` the ``k`` most likely tokens of each row
            (``k`` = the largest ``logprobs`` asked for in the step), or ``None``.
        first_scheduled: ids of the requests scheduled for the first time in this step.
        scheduled_time: ``time.monotonic()`` when the step was scheduled (seconds).
    """

    request_ids: list[str] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finish_reasons: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    logprobs: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    first_scheduled: list[str] = field(default_factory=list)
    scheduled_time: float = 0.0
