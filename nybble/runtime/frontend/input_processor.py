"""The request gate (vLLM's input processor): every request is completed and checked here, once.

A request enters as a prompt (text or token ids) and a :class:`SamplingParams`; it leaves as
an :class:`EngineCoreRequest` that the engine core trusts, or as one
:class:`InvalidRequestError` whose ``param`` names the offending parameter (the server turns it
into a 400 with an OpenAI error body). The gate resolves ``max_tokens=None`` to the rest of
the context of *this* prompt, marks a request with ``max_tokens`` 0 ``prompt_only`` (the core
and the output side read that field, not the 0), turns a ``top_p`` too small for float32
(:data:`FLOAT32_TINY`) into greedy sampling, and checks, in order:

1. every sampling range (``n``, ``best_of`` (``>= n``), ``temperature``, ``top_p``,
   ``top_k``, ``min_p``, ``seed``, ``max_tokens`` (``0``: score the prompt only),
   ``logprobs`` and ``prompt_logprobs`` against ``max_logprobs`` and the vocabulary,
   ``stop``, ``stop_token_ids`` in the vocabulary; the table is in docs/serving.md), and the
   logit shaping and structured-output parameters (:mod:`nybble.runtime.frontend.shaping_checks`);
2. the prompt: non-empty, every id in the vocabulary;
3. prompt + ``max_tokens`` within ``max_model_len`` (one message, naming both numbers);
4. ``n`` (``best_of`` when set, or the beam width) within ``max_num_seqs`` (the samples of a
   request run in one batch);
5. the request fits the whole KV pool (``KVCacheExhaustedError``), so the scheduler, which
   only asserts, can always run the oldest sequence alone (a beam-search request: all its
   beams, unshared).

Beam search (``use_beam_search``) also needs ``n <= beam_width``, ``temperature == 0``, no
``logprobs``, no ``stop`` strings, a finite ``length_penalty``, ``early_stopping`` in
``True, False, "never"`` and its candidates per step (:func:`num_candidates`) within the
vocabulary; without it, the beam parameters must keep their defaults.

With speculative decoding on, beam search, structured output and ``prompt_logprobs`` are
refused (docs/serving.md §1.7a); ``min_tokens`` and logit shaping are applied at every verified
position by the model runner.

The gate holds no mutable state: it may run on any thread. It runs in the API process (the
server calls it on its event loop or a worker thread, before the request goes to the
engine-core process) and, offline, on the caller's thread in :class:`LLMEngine`.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from nybble.errors import InvalidRequestError
from nybble.lora_request import LoRARequest
from nybble.runtime.messages import EngineCoreRequest, RequestLimits
from nybble.runtime.frontend.shaping_checks import (
    bad_words_token_ids,
    check_guided,
    check_min_tokens,
    check_shaping,
)
from nybble.runtime.scheduler.scheduler_input import check_kv_fit
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, num_candidates

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_NAMES", "FLOAT32_TINY", "InputProcessor", "ParamNames", "RequestLimits"]

FLOAT32_MAX = 3.4028234663852886e38
"""float32's largest finite value: the sampler computes in float32."""
FLOAT32_TINY = 1.1754943508222875e-38
"""float32's smallest normal value. A ``top_p`` below it would round to zero (or to a
denormal that GPUs flush to zero) and drop every token; the gate treats such a ``top_p`` as
its limit, greedy sampling (``top_p -> 0`` keeps only the most likely token)."""


@dataclass(frozen=True, slots=True)
class ParamNames:
    """The API's names of the parameters the gate reports in an error's ``param``.

    The chat API calls the prompt ``messages``, the budget ``max_completion_tokens`` (or
    ``max_tokens``) and the number of alternatives ``top_logprobs``.
    """

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"


DEFAULT_NAMES = ParamNames()
"""vLLM's and the completions API's names."""


_BEAM_NEUTRAL = (("logit_bias", None), ("min_tokens", 0), ("repetition_penalty", 1.0),
                 ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("bad_words", None),
                 ("allowed_token_ids", None), ("guided_decoding", None), ("best_of", None),
                 ("prompt_logprobs", None))
"""Parameters beam search does not apply (logit shaping, best_of, prompt logprobs), with
their neutral values."""


_SPECULATIVE_REFUSES = (("use_beam_search", False), ("guided_decoding", None),
                        ("prompt_logprobs", None))
"""What speculative decoding does not apply, with the neutral values (docs/serving.md §1.7a
says why); logit shaping and ``min_tokens`` it applies at every verified position."""


def _fail(name: str, allowed: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {allowed}, got {value!r}", param=name)


def check_vocabularies(num_tokens: int, vocab_size: int) -> bool:
    """Warn (once, at start-up) when the tokenizer's ``num_tokens`` (added tokens included)
    cannot be the model's: more than its ``vocab_size`` embedding rows, or fewer than 90% of
    them (a model's vocabulary is at most padded to a round size, never 10% larger). A
    mismatched ``--tokenizer`` otherwise shows only as garbled text. Returns whether they
    match."""
    if num_tokens > vocab_size or num_tokens < 0.9 * vocab_size:
        logger.warning("the tokenizer has %d tokens but the model's vocabulary has %d: is the "
                       "tokenizer (--tokenizer) the model's? Generated ids it does not know "
                       "decode to nothing, and prompt ids past the model's vocabulary are "
                       "refused", num_tokens, vocab_size)
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class InputProcessor:
    """Turns ``(prompt, SamplingParams)`` into a validated :class:`EngineCoreRequest`.

    Args:
        tokenizer: the model's tokenizer (text prompts only).
        limits: the engine's limits.
        eos_token_ids: the model's EOS ids (stop ids unless ``ignore_eos``).
    """

    def __init__(self, tokenizer: Tokenizer, limits: RequestLimits,
                 eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = tuple(eos_token_ids)
        check_vocabularies(tokenizer.vocab_size, limits.vocab_size)

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                arrival_time: float | None = None,
                names: ParamNames = DEFAULT_NAMES,
                lora_request: LoRARequest | None = None) -> EngineCoreRequest:
        """Complete and check one request.

        Args:
            prompt: text (tokenized here, with the tokenizer's BOS), or token ids used as
                they are.
            names: the API's parameter names, for the error's ``param``.
            lora_request: the LoRA adapter it runs under (``None``: the base model).

        Raises:
            InvalidRequestError: a value outside its range, naming the parameter;
                ``KVCacheExhaustedError`` (a subclass) when the request cannot fit the pool.
        """
        self.check_params(params, names)
        if lora_request is not None:
            if self.limits.lora is None:
                raise InvalidRequestError("a LoRA adapter needs an engine started with "
                                          "enable_lora (--enable-lora)", param="model")
            if params.use_beam_search:
                raise InvalidRequestError("beam search with a LoRA adapter is not supported",
                                          param="use_beam_search")
        if isinstance(prompt, str):
            if not prompt:
                raise _fail(names.prompt, "non-empty", prompt)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.check_token_ids(ids, names.prompt)
        max_tokens = self._resolve_max_tokens(len(ids), params.max_tokens, names)
        if params.use_beam_search:
            width = params.n if params.beam_width is None else params.beam_width
            self._check_capacity(len(ids), max_tokens, width, names, all_at_once=True,
                                 n_name="n" if params.beam_width is None else "beam_width")
        else:
            self._check_capacity(len(ids), max(max_tokens, 1), params.num_sequences, names,
                                 n_name="n" if params.best_of is None else "best_of")
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in self.eos_token_ids if t not in stop_ids]
        check_min_tokens(params.min_tokens, max_tokens, names.max_tokens)  # resolved now
        changes: dict[str, object] = {"max_tokens": max_tokens}
        if params.temperature > 0 and params.top_p < FLOAT32_TINY:
            changes["temperature"] = 0.0  # NOTE: it would round to 0 in the sampler
        if params.guided_decoding is not None:
            changes["guided_decoding"] = check_guided(params.guided_decoding)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words or [])
        return EngineCoreRequest(
            request_id=request_id, prompt_token_ids=ids,
            params=dataclasses.replace(params, **changes), stop_token_ids=stop_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            bad_words_token_ids=bad_words, prompt_only=max_tokens == 0,
            lora_request=lora_request)

    def check_token_ids(self, ids: Sequence[int], param: str, allow_empty: bool = False) -> None:
        """Reject an empty list (unless ``allow_empty``) or ids outside the vocabulary.

        Raises:
            InvalidRequestError: with ``param`` as the parameter.
        """
        if not ids and not allow_empty:
            raise _fail(param, "non-empty", list(ids))
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{param} must hold token ids in [0, {vocab}), got "
                                      f"{bad[:5]}", param=param)

    def check_params(self, p: SamplingParams, names: ParamNames = DEFAULT_NAMES) -> None:
        """Check every range of ``p`` that does not depend on the prompt.

        Raises:
            InvalidRequestError: naming the first parameter out of range.
        """
        self._check_speculative(p)
        self._check_beam(p, names)   # NOTE: first: the beam width is the offline API's n
        if not _is_int(p.n) or p.n < 1:
            raise _fail("n", "an integer >= 1", p.n)
        if p.best_of is not None and (not _is_int(p.best_of) or p.best_of < p.n):
            raise _fail("best_of", f"an integer >= n ({p.n})", p.best_of)
        if not _is_real(p.temperature) or not 0 <= p.temperature <= FLOAT32_MAX:
            raise _fail("temperature", f"a finite number >= 0 (at most {FLOAT32_MAX:.7g}, "
                        f"float32's largest)", p.temperature)
        if not _is_real(p.top_p) or not 0 < p.top_p <= 1:  # NOTE: NaN fails every comparison
            raise _fail("top_p", "in (0, 1]", p.top_p)
        if not _is_int(p.top_k) or not -1 <= p.top_k <= self.limits.vocab_size:
            raise _fail("top_k", f"-1 or 0 (disabled) or an integer in [1, "
                        f"{self.limits.vocab_size}] (the vocabulary)", p.top_k)
        if not _is_real(p.min_p) or not 0 <= p.min_p <= 1:
            raise _fail("min_p", "in [0, 1]", p.min_p)
        if p.seed is not None and (not _is_int(p.seed) or not SEED_MIN <= p.seed <= SEED_MAX):
            raise _fail("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}] (-1: no seed)", p.seed)
        if p.max_tokens is not None and (not _is_int(p.max_tokens) or p.max_tokens < 0):
            raise _fail(names.max_tokens, ">= 0", p.max_tokens)
        cap = min(self.limits.max_logprobs, self.limits.vocab_size)
        for name, value in ((names.logprobs, p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
            if value is not None and (not _is_int(value) or not 0 <= value <= cap):
                raise _fail(name, f"in [0, {cap}] (max_logprobs {self.limits.max_logprobs}, "
                            f"vocabulary {self.limits.vocab_size} tokens)", value)
        if any(not isinstance(s, str) or not s for s in p.stop_list):
            raise _fail("stop", "non-empty strings", p.stop)
        self.check_token_ids(p.stop_token_ids or [], "stop_token_ids", allow_empty=True)
        check_shaping(p, self.limits.vocab_size, names.max_tokens)

    def _check_speculative(self, p: SamplingParams) -> None:
        """With speculative decoding on, the parameters its verification does not apply
        (beam search, structured output, prompt logprobs) are refused."""
        if not self.limits.speculative:
            return
        for name, neutral in _SPECULATIVE_REFUSES:
            value = getattr(p, name)
            if value is not None and value != neutral and value not in ({}, []):
                raise _fail(name, f"unset while speculative decoding is on (not supported "
                            f"with --speculative-config), or {neutral!r}", value)

    def _check_beam(self, p: SamplingParams, names: ParamNames) -> None:
        """The beam-search parameters (see the module docstring)."""
        if p.use_beam_search is not True and p.use_beam_search is not False:
            raise _fail("use_beam_search", "true or false", p.use_beam_search)
        if not p.use_beam_search:
            for name, default in (("beam_width", None), ("length_penalty", 1.0),
                                  ("early_stopping", False)):
                if getattr(p, name) != default:
                    raise _fail(name, f"{default!r} unless use_beam_search is set",
                                getattr(p, name))
            return
        width_name = "n" if p.beam_width is None else "beam_width"
        width = p.n if p.beam_width is None else p.beam_width
        if not _is_int(width) or width < 1:
            raise _fail(width_name, "an integer >= 1 (the beam width)", width)
        if _is_int(p.n) and p.n > width:
            raise _fail("n", f"<= the beam width ({width})", p.n)
        if _is_int(p.max_tokens) and p.max_tokens < 1:
            raise _fail(names.max_tokens, ">= 1 with use_beam_search (nothing to search)",
                        p.max_tokens)
        if p.temperature != 0:
            raise _fail("temperature", "0 with use_beam_search (beam search is "
                        "deterministic)", p.temperature)
        if p.logprobs is not None:
            raise _fail(names.logprobs, "unset with use_beam_search (not supported)",
                        p.logprobs)
        if p.stop_list:
            raise _fail("stop", "unset with use_beam_search (stop strings are not "
                        "supported; stop_token_ids are)", p.stop)
        for name, neutral in _BEAM_NEUTRAL:   # NOTE: beams rank raw logprobs, unshaped
            value = getattr(p, name)
            if value is not None and value != neutral and value not in ({}, []):
                also = "" if neutral is None else f"; {neutral!r} counts as unset"
                raise _fail(name, f"unset with use_beam_search (beams do not support it{also})",
                            value)
        if not _is_real(p.length_penalty) or not abs(p.length_penalty) <= FLOAT32_MAX:
            raise _fail("length_penalty", "a finite number", p.length_penalty)
        if not any(p.early_stopping is v for v in (True, False)) and p.early_stopping != "never":
            raise _fail("early_stopping", 'true, false or "never"', p.early_stopping)
        eos = set(p.stop_token_ids or []) | set(() if p.ignore_eos else self.eos_token_ids)
        cands, vocab = num_candidates(width, len(eos)), self.limits.vocab_size
        if cands > vocab:
            raise _fail(width_name, f"at most {vocab // max(2, 1 + len(eos))} (each step "
                        f"keeps max(2, 1 + {len(eos)} stop ids) x width candidates, at most "
                        f"the vocabulary of {vocab})", width)

    def _resolve_max_tokens(self, num_prompt: int, max_tokens: int | None,
                            names: ParamNames) -> int:
        """``max_tokens``, or the rest of the context when ``None``; the length check."""
        limit = self.limits.max_model_len
        resolved = limit - num_prompt if max_tokens is None else max_tokens
        least = 0 if max_tokens == 0 else max(resolved, 1)  # NOTE: 0 scores a full context
        if num_prompt + least > limit:
            why = "" if max_tokens is not None else \
                f" ({names.max_tokens} was not set: the prompt leaves no room to generate)"
            raise InvalidRequestError(
                f"{names.prompt} + {names.max_tokens} must be <= max_model_len ({limit} "
                f"tokens), got {num_prompt} prompt tokens + {least} {names.max_tokens} = "
                f"{num_prompt + least}{why}",
                param=names.max_tokens if max_tokens is not None else names.prompt)
        return resolved

    def _check_capacity(self, num_prompt: int, max_tokens: int, n: int,
                        names: ParamNames, all_at_once: bool = False,
                        n_name: str = "n") -> None:
        """``n`` (named ``n_name``) within ``max_num_seqs``; the request's longest sequence
        within the pool (``all_at_once``: ``n`` of them, the beams of a beam search, which
        advance together), by the scheduler's own rule, :func:`check_kv_fit`."""
        cap = self.limits.max_num_seqs
        if n > cap:
            raise InvalidRequestError(f"{n_name} must be <= {cap} (max_num_seqs: the samples "
                                      f"of a request run in one batch), got {n}", param=n_name)
        lim = self.limits
        check_kv_fit(num_prompt, max_tokens, lim.max_model_len, lim.block_size,
                     lim.num_kv_blocks, num_sequences=n if all_at_once else 1,
                     max_tokens_name=names.max_tokens, sliding_window=lim.sliding_window,
                     max_num_batched_tokens=lim.max_num_batched_tokens)
