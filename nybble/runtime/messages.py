"""The typed messages between the engine's parts, and their wire format (vLLM V1's split).

::

    prompt, SamplingParams ──> InputProcessor (the request gate) ──> EngineCoreRequest
    EngineCoreRequest ──> EngineCore (scheduler + model runner) ──> EngineCoreOutputs per step
    EngineCoreOutputs ──> OutputProcessor (detokenizer, stop strings) ──> RequestOutput

The engine core deals in token ids only: no text, no tokenizer. In ``nybble serve`` the core
runs in its own process and these messages cross a ZeroMQ socket as msgpack (``msgspec``):

- API process -> core: :class:`CoreInputs` (new requests, stop-string finishes and aborts,
  batched: everything queued during one event-loop turn goes in one message),
  :class:`UtilityCall` (``get_stats``), :class:`Shutdown`;
- core -> API process: :class:`EngineCoreReady` or :class:`EngineCoreStartupFailed` (the
  handshake), then one :class:`EngineCoreOutputs` per step (token ids of every sampled
  sequence, logprobs when asked, finish codes, the scheduler's counters),
  :class:`UtilityResult`, :class:`RequestsFailed` and :class:`EngineCoreFatal`.

Every field is a plain value, a list or a struct, so this module imports neither numpy nor
torch (the API process imports it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from nybble.lora_request import LoRARequest
from nybble.sampling_params import SamplingParams


class LoRALimits(msgspec.Struct, frozen=True):
    """What LoRA adapters the engine serves (the API side checks an adapter folder against
    it before loading: :func:`nybble.lora_files.read_adapter`).

    Attributes:
        max_loras: device slots; max_lora_rank: the largest rank.
        num_layers: the base's decoder layers.
        shapes: projection name -> ``[in_features, out_features]`` of the base.
    """

    max_loras: int
    max_lora_rank: int
    num_layers: int
    shapes: dict[str, tuple[int, int]]


class RequestLimits(msgspec.Struct, frozen=True):
    """What the engine can serve, fixed at start-up (the request gate checks against it).

    Attributes:
        max_model_len: longest sequence, prompt + output (tokens).
        vocab_size: valid token ids are ``[0, vocab_size)``.
        max_num_seqs: most sequences in one step (caps ``n``).
        max_logprobs: largest ``logprobs`` a request may ask for.
        num_kv_blocks, block_size: the KV pool (blocks, tokens per block).
        speculative: speculative decoding is on (some parameters are refused with it).
        lora: the LoRA adapters it can serve, ``None`` when LoRA is off.
        sliding_window: the window out of which the scheduler frees KV blocks (tokens), or
            None; with it a sequence holds at most a window's blocks at a time.
        max_num_batched_tokens: tokens per step (bounds the blocks of a windowed sequence).
    """

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_logprobs: int
    num_kv_blocks: int
    block_size: int
    speculative: bool = False
    lora: LoRALimits | None = None
    sliding_window: int | None = None
    max_num_batched_tokens: int = 0


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters since start-up (vLLM's ``spec_decode_*`` metrics).

    Attributes:
        num_drafts: sequence-steps that carried drafts.
        num_draft_tokens: tokens proposed (drafted).
        num_accepted_tokens: drafts the target accepted.
        accepted_per_pos: ``k`` counts: drafts accepted at position ``i`` of a proposal.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, k: int) -> SpecDecodeStats:
        """Zero counters for proposals of up to ``k`` tokens."""
        return cls(accepted_per_pos=[0] * k)

    def add(self, num_draft, counts) -> None:
        """Count one step: ``num_draft[r]`` drafts of sample row ``r``, ``counts[r] - 1`` of
        them accepted (int arrays)."""
        drafted = num_draft > 0
        accepted = (counts - 1)[drafted]
        self.num_drafts += int(drafted.sum())
        self.num_draft_tokens += int(num_draft.sum())
        self.num_accepted_tokens += int(accepted.sum())
        for i in range(len(self.accepted_per_pos)):
            self.accepted_per_pos[i] += int((accepted > i).sum())

    def snapshot(self) -> SpecDecodeStats | None:
        """A copy, or ``None`` when speculative decoding is off (no positions)."""
        if not self.accepted_per_pos:
            return None
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_pos))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load (all counts are sequences, blocks or tokens).

    ``kv_cache_usage`` is the fraction of KV blocks in use (0..1; parked prefix-cache blocks
    count as free; ``num_blocks`` leaves out a sliding window's null block, which is never
    handed out); ``num_live_tokens`` the tokens whose K/V the sequences of the last step
    still hold (the sum of their ``seq_lens``, less those that finished), for KV-waste figures:
    ``1 - num_live_tokens / (used_blocks * block_size)``. With prefix caching,
    ``num_cached_tokens_total`` counts the tokens admitted sequences found in the cache (not
    computed) and ``prefix_cache_hit_rate`` is that over the tokens of the sequences admitted
    (0 when caching is off or nothing was admitted). ``spec_decode``: the speculative
    decoding counters, ``None`` when it is off. With LoRA on, ``lora_running`` /
    ``lora_waiting`` count the requests per adapter name that hold a device slot / wait for
    one, of ``max_loras`` slots (vLLM's ``lora_requests_info``).
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    peak_num_seqs_in_step: int
    num_steps: int
    num_live_tokens: int
    block_size: int
    num_cached_tokens_total: int = 0
    num_prefix_query_tokens_total: int = 0
    prefix_cache_hit_rate: float = 0.0
    spec_decode: SpecDecodeStats | None = None
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0


class EngineCoreRequest(msgspec.Struct, frozen=True):
    """A request the gate has validated and completed; the core trusts every field.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt's ids (non-empty, all in the vocabulary).
        params: the sampling parameters, with ``max_tokens`` resolved to an int.
        stop_token_ids: ids that end a sequence in the scheduler: the user's
            ``stop_token_ids`` plus the model's EOS ids unless ``ignore_eos``.
        arrival_time: ``time.monotonic()`` when the request arrived (seconds; the clock is
            shared by the processes of one machine).
        bad_words_token_ids: ``params.bad_words`` tokenized by the gate (each word with and
            without a leading space; vLLM's rule); empty when there are none.
        prompt_only: score the prompt only (the caller asked for ``max_tokens`` 0): the core
            runs the request for one token, so that its prompt is computed (prompt logprobs),
            and the output side drops that token. Set by the gate; nothing else reads a 0
            budget.
        lora_request: the LoRA adapter it runs under, ``None`` for the base model.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: list[int]
    arrival_time: float
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    prompt_only: bool = False
    lora_request: LoRARequest | None = None

    @property
    def max_tokens(self) -> int:
        """The resolved generation budget (tokens)."""
        assert self.params.max_tokens is not None, "the gate resolves max_tokens"
        return self.params.max_tokens


class PromptLogprobs(msgspec.Struct):
    """Logprobs of some prompt tokens of one request, computed in one step (a prefill chunk).

    Attributes:
        request_id: the request.
        start: index in the prompt of the first token here (>= 1: token 0 has none).
        logprobs: ``L`` logprobs of prompt tokens ``start .. start + L - 1``.
        top_token_ids, top_logprobs: ``L`` rows of the ``prompt_logprobs`` most likely
            tokens at each position (empty rows when it is 0).
    """

    request_id: str
    start: int
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


class EngineCoreOutputs(msgspec.Struct, tag=True):
    """What one core step produced, column by column: row ``r`` is one sampled sequence.

    Attributes:
        request_ids: ``S`` request ids.
        sample_indices: ``S`` sample indices in ``[0, n)``.
        token_ids: ``S`` sampled token ids.
        finish_reasons: ``S`` ``FinishReason`` codes (0: still running, 1: a stop token id,
            2: length).
        logprobs: ``S`` log-probabilities of the sampled tokens, or ``None`` when no row
            asked for logprobs.
        top_token_ids, top_logprobs: ``S`` rows of the ``k`` most likely tokens (``k`` = the
            largest ``logprobs`` asked for in the step), or ``None``.
        prompt_logprobs: prompt logprobs computed in this step (requests asking for
            ``prompt_logprobs``; a chunked prompt's come over several steps, all before or
            with its first sampled token), or ``None``.
        first_scheduled: ids of the requests scheduled for the first time in this step.
        num_cached_tokens: per ``first_scheduled`` id, the prompt tokens its first step found
            in the prefix cache (their K/V was not computed again).
        cumulative_logprobs: per beam-search request that ended in this step, the
            cumulative log-probability of each returned beam (by sample index); its rows
            carry each beam's whole token ids at once.
        scheduled_time: ``time.monotonic()`` when the step was scheduled (seconds).
        stats: the engine's counters after the step (set by the core process; a message
            with no rows and only ``stats`` says the core went idle).
    """

    request_ids: list[str] = msgspec.field(default_factory=list)
    sample_indices: list[int] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reasons: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[PromptLogprobs] | None = None
    first_scheduled: list[str] = msgspec.field(default_factory=list)
    num_cached_tokens: list[int] = msgspec.field(default_factory=list)
    cumulative_logprobs: dict[str, list[float]] | None = None
    scheduled_time: float = 0.0
    stats: EngineStats | None = None


# ---------------------------------------------------------------- API process -> engine core
class CoreInputs(msgspec.Struct, tag=True):
    """Everything the API process queued for the core since its last message, applied in
    this order: ``adds``, then ``finishes``, then ``aborts``.

    Attributes:
        adds: new requests.
        finishes: ``(request_id, sample_index)`` samples a stop string ended (finished
            ``STOPPED``; the output side already cut the text).
        aborts: requests to drop (client gone, server shutting down).
    """

    adds: list[EngineCoreRequest] = msgspec.field(default_factory=list)
    finishes: list[tuple[str, int]] = msgspec.field(default_factory=list)
    aborts: list[str] = msgspec.field(default_factory=list)


class UtilityCall(msgspec.Struct, tag=True):
    """Call a read-only core method between steps; answered by :class:`UtilityResult`.

    Attributes:
        call_id: echoed in the result.
        method: ``"get_stats"``.
    """

    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag=True):
    """Stop the busy loop and exit."""


# ---------------------------------------------------------------- engine core -> API process
class EngineCoreReady(msgspec.Struct, tag=True):
    """The handshake: what the API process needs from the loaded engine.

    Attributes:
        limits: what the request gate checks against (KV pool, block size, max_model_len,
            vocabulary, ...).
        eos_token_ids: the model's EOS ids (stop ids unless ``ignore_eos``).
        tokenizer_json: the tokenizer as ``tokenizer.json`` text when the tokenizer folder
            has no such file (converted by transformers in the core), else ``None``.
        threads: the core's torch intra-op threads.
        pid: the core's process id.
    """

    limits: RequestLimits
    eos_token_ids: list[int]
    tokenizer_json: str | None = None
    threads: int = 1
    pid: int = 0


class EngineCoreStartupFailed(msgspec.Struct, tag=True):
    """The core could not start.

    Attributes:
        message: one line for the user.
        user_error: a bad model folder or flag (exit code 2), not a crash.
    """

    message: str
    user_error: bool


class UtilityResult(msgspec.Struct, tag=True):
    """The answer to a :class:`UtilityCall` (``error`` set when it raised)."""

    call_id: int
    result: EngineStats | None = None
    error: str | None = None


class RequestsFailed(msgspec.Struct, tag=True):
    """Requests the core dropped after an error (they got no more tokens): the requests of a
    failed step's batch, a request whose admission failed, or every request left when the
    core gives up.

    Attributes:
        param: set when the core refused the request itself (its structured-output grammar
            does not compile): the parameter to name in a 400.
    """

    request_ids: list[str]
    message: str
    param: str | None = None


class EngineCoreFatal(msgspec.Struct, tag=True):
    """The core can no longer step (repeated step failures, or its own bookkeeping failed)
    and exits after this."""

    message: str


ToCore = CoreInputs | UtilityCall | Shutdown
FromCore = (EngineCoreOutputs | EngineCoreReady | EngineCoreStartupFailed | UtilityResult
            | RequestsFailed | EngineCoreFatal)


class Codec:
    """msgpack encoder and decoder for one direction of the core's sockets.

    Args:
        incoming: the union of message types this side receives (``ToCore`` in the core,
            ``FromCore`` in the API process).
    """

    def __init__(self, incoming: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: msgspec.Struct) -> bytes:
        """The msgpack bytes of ``message``."""
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> object:
        """The message in ``data``.

        Raises:
            msgspec.DecodeError: ``data`` is not a message of the incoming union.
        """
        return self._decoder.decode(data)
