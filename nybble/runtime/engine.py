"""LLMEngine: schedule -> execute -> update, one iteration per :meth:`LLMEngine.step`.

Continuous (iteration-level) batching as in Orca (Yu et al., OSDI 2022) over a paged KV cache
(PagedAttention, Kwon et al., SOSP 2023). The Cython scheduler decides which tokens run; the
model runner computes and samples; the engine turns sampled ids into text, applies stop
strings and reports cumulative :class:`RequestOutput` objects (vLLM's API).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from nybble.config import EngineConfig
from nybble.errors import InvalidRequestError
from nybble.kernels import get_attention_backend
from nybble.models.loader import check_model_dir, load_model
from nybble.outputs import RequestOutput
from nybble.runtime.kv_cache import plan_kv_cache
from nybble.runtime.model_runner import ModelRunner
from nybble.runtime.request import FINISH_REASON_OPENAI, FinishReason, Request
from nybble.runtime.sampler import SamplerOutput, SamplingBatch
from nybble.runtime.scheduler import Scheduler
from nybble.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load (all counts are sequences, blocks or tokens).

    ``kv_cache_usage`` is the fraction of KV blocks in use (0..1; parked prefix-cache blocks
    count as free); ``num_live_tokens`` the tokens whose K/V the sequences of the last step
    still hold (the sum of their ``seq_lens``, less those that finished), for KV-waste figures:
    ``1 - num_live_tokens / (used_blocks * block_size)``. With prefix caching,
    ``num_cached_tokens_total`` counts the tokens admitted sequences found in the cache (not
    computed) and ``prefix_cache_hit_rate`` is that over the tokens of the sequences admitted
    (0 when caching is off or nothing was admitted).
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


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device must be 'cpu' or 'auto' on a machine without CUDA, got 'cuda'")
    return torch.device(name)


class LLMEngine:
    """The engine: add requests, call :meth:`step` until :meth:`has_unfinished_requests` is
    false. Not thread-safe: drive it from one thread (``AsyncEngine`` does this for the server).

    Raises (constructor):
        UnsupportedModelError: the model folder cannot be served.
        ValueError: a configuration value out of range.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device = _resolve_device(mc.device)
        check_model_dir(mc.model)
        if mc.tokenizer is not None and not os.path.isdir(mc.tokenizer):
            raise ValueError(f"tokenizer must be a local folder, got {mc.tokenizer!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model)
        # NOTE: the engine enforces max_model_len itself; the tokenizer's own limit would only
        # log a misleading "indexing errors" warning for prompts that are then rejected.
        self.tokenizer.model_max_length = 1 << 62
        backend = get_attention_backend(config.attention_backend, self.device)
        self.loaded = load_model(mc, backend, self.device)
        hf = self.loaded.hf_config
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        self.kv_spec = plan_kv_cache(config.cache_config, hf.num_hidden_layers, kv_heads,
                                     head_dim, self.loaded.dtype, self.device)
        self.runner = ModelRunner(self.loaded, self.kv_spec, self.device, mc.seed)
        sc = config.scheduler_config
        self.max_model_len = self.loaded.max_model_len
        self.scheduler = Scheduler(self.kv_spec.num_blocks, self.kv_spec.block_size,
                                   sc.max_num_seqs, sc.max_num_batched_tokens,
                                   self.max_model_len, sc.enable_chunked_prefill,
                                   enable_prefix_caching=config.cache_config.enable_prefix_caching)
        self.model_name = mc.name
        self.vocab_size = int(hf.vocab_size)
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, tuple[Request, int]] = {}  # seq id -> (request, sample index)
        self._unscheduled: dict[int, Request] = {}  # first seq id -> request not yet run
        self._next_seq_id = 0
        self._peak_seqs = self._num_steps = self._live_tokens = 0
        logger.info("model %s (%s), dtype %s, device %s, quantization %s, weights %d bytes "
                    "(%.2f MiB; linear layers %d bytes)", self.model_name, mc.model,
                    str(self.loaded.dtype).replace("torch.", ""), self.device,
                    self.loaded.quant_description, self.loaded.weight_bytes,
                    self.loaded.weight_bytes / 2**20, self.loaded.linear_weight_bytes)
        logger.info("KV cache: %d blocks x %d tokens, %d bytes/block, %.2f MiB in all; "
                    "max_model_len %d; prefix caching %s", self.kv_spec.num_blocks,
                    self.kv_spec.block_size, self.kv_spec.bytes_per_block,
                    self.kv_spec.total_bytes / 2**20, self.max_model_len,
                    "on" if config.cache_config.enable_prefix_caching else "off")

    @classmethod
    def from_engine_args(cls, model: str | None = None, **kwargs: Any) -> LLMEngine:
        """Build from vLLM-style keyword arguments (see :meth:`EngineConfig.from_kwargs`)."""
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # ----------------------------------------------------------------- requests
    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must be a non-empty string", param="prompt")
            return prompt, list(self.tokenizer(prompt).input_ids)
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}), "
                                      f"got {bad[:5]}", param="prompt")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request (text prompt, or token ids used as they are).

        Raises:
            InvalidRequestError: duplicate id, empty prompt, token ids out of the vocabulary,
                prompt + ``max_tokens`` over ``max_model_len``, ``n`` over ``max_num_seqs``,
                or a request larger than the whole KV pool (``KVCacheExhaustedError``).
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id must be unique, got {request_id!r} twice")
        text, ids = self._prompt_ids(prompt)
        limit = self.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max(max_tokens, 1) > limit:
            raise InvalidRequestError(
                f"prompt length plus max_tokens must be <= max_model_len ({limit} tokens), got "
                f"{len(ids)} prompt tokens + {max_tokens} max_tokens = "
                f"{len(ids) + max_tokens}", param="max_tokens")
        cap = self.config.scheduler_config.max_num_seqs
        if params.n > cap:
            raise InvalidRequestError(f"n must be <= {cap} (max_num_seqs: the samples of a "
                                      f"request run in one batch), got {params.n}", param="n")
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in self.loaded.eos_token_ids if t not in stop_ids]
        seq_id = self._next_seq_id
        self.scheduler.add(seq_id, np.asarray(ids, dtype=np.int32), max_tokens,
                           np.asarray(stop_ids, dtype=np.int32), params.n)
        self._next_seq_id += params.n
        now = time.monotonic()
        request = Request.create(request_id, text, ids, params, seq_id,
                                 arrival_time if arrival_time is not None else now,
                                 self.tokenizer, self.device)
        self.requests[request_id] = request
        self._unscheduled[seq_id] = request
        for i in range(params.n):
            self._seqs[seq_id + i] = (request, i)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now; their KV blocks are freed at once. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            self._unscheduled.pop(request.first_seq_id, None)
            for i, sample in enumerate(request.samples):
                seq_id = request.first_seq_id + i
                self._seqs.pop(seq_id, None)
                if sample.output.finish_reason is None:
                    self.scheduler.finish(seq_id, int(FinishReason.ABORTED))
                    sample.output.finish_reason = FINISH_REASON_OPENAI[FinishReason.ABORTED]

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule -> execute -> update. Returns a cumulative
        :class:`RequestOutput` for every request that produced tokens in this step."""
        batch = self.scheduler.schedule()
        if batch.num_seqs == 0:
            return []
        self._note_scheduled(batch.seq_ids)
        result = self.runner.execute(batch, self._sampling_batch(batch.sample_seq_ids))
        sampled = result.token_ids.to(device="cpu", dtype=torch.int32).numpy()
        seq_ids, tokens, finish = self.scheduler.update(batch, sampled)
        finished: list[int] = []
        outputs = self._process(seq_ids, tokens, finish, result, finished)
        # Tokens whose K/V the step's sequences still hold (finished ones freed their blocks).
        still_running = ~np.isin(batch.seq_ids, finished)
        self._live_tokens = int(batch.seq_lens[still_running].sum())
        return outputs

    def _note_scheduled(self, seq_ids: np.ndarray) -> None:
        self._num_steps += 1
        self._peak_seqs = max(self._peak_seqs, len(seq_ids))
        if self._unscheduled:
            now = time.monotonic()
            for sid in set(seq_ids.tolist()) & self._unscheduled.keys():
                self._unscheduled.pop(sid).metrics.first_scheduled_time = now

    def _sampling_batch(self, sample_seq_ids: np.ndarray) -> SamplingBatch:
        """Per-row sampling parameters for the rows about to be sampled."""
        rows = [self._seqs[sid] for sid in sample_seq_ids.tolist()]
        ps = [r.params for r, _ in rows]
        f32 = dict(dtype=torch.float32, device=self.device)
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in ps], **f32),
            top_p=torch.tensor([p.top_p for p in ps], **f32),
            top_k=torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=self.device),
            min_p=torch.tensor([p.min_p for p in ps], **f32),
            generators=[r.samples[i].generator for r, i in rows],
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1))

    def _process(self, seq_ids: np.ndarray, tokens: np.ndarray, finish: np.ndarray,
                 result: SamplerOutput, finished: list[int]) -> list[RequestOutput]:
        """Append sampled tokens, detokenize, apply stop strings; ``finished`` collects the
        ids of sequences that ended in this step."""
        now = time.monotonic()
        changed: dict[str, Request] = {}
        for row, (sid, token, code) in enumerate(zip(seq_ids.tolist(), tokens.tolist(),
                                                     finish.tolist())):
            request, index = self._seqs[sid]
            sample = request.samples[index]
            out = sample.output
            out.token_ids.append(token)
            if out.logprobs is not None:
                out.logprobs.append(self._row_logprobs(result, row, token,
                                                       request.params.logprobs or 0))
            reason = FinishReason(code)
            if reason == FinishReason.STOPPED:
                out.stop_reason = token if token in request.params.stop_token_ids else None
            else:  # NOTE: a stop token is kept in token_ids but never detokenized
                sample.detok.add_token(token)
                if reason == FinishReason.NONE and sample.detok.stop_reason is not None:
                    self.scheduler.finish(sid, int(FinishReason.STOPPED))
                    reason, out.stop_reason = FinishReason.STOPPED, sample.detok.stop_reason
            out.text += sample.detok.take_delta(finished=reason != FinishReason.NONE)
            m = request.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            request.new_tokens += 1
            if reason != FinishReason.NONE:
                out.finish_reason = FINISH_REASON_OPENAI[reason]
                request.num_finished += 1
                del self._seqs[sid]
                finished.append(sid)
            changed[request.request_id] = request
        outputs = []
        for request in changed.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(request.to_output())
            request.new_tokens = 0
        return outputs

    @staticmethod
    def _row_logprobs(result: SamplerOutput, row: int, token: int, k: int) -> dict[int, float]:
        assert result.logprobs is not None
        entry = {token: float(result.logprobs[row])}
        if k > 0 and result.top_ids is not None and result.top_logprobs is not None:
            for tid, lp in zip(result.top_ids[row, :k].tolist(),
                               result.top_logprobs[row, :k].tolist()):
                entry.setdefault(tid, lp)
        return entry

    # ----------------------------------------------------------------- stats
    def get_stats(self) -> EngineStats:
        """Current load; see :class:`EngineStats`."""
        s = self.scheduler
        used = s.num_blocks - s.num_free_blocks
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           num_free_blocks=s.num_free_blocks, num_blocks=s.num_blocks,
                           kv_cache_usage=used / s.num_blocks, num_preemptions=s.num_preemptions,
                           peak_num_seqs_in_step=self._peak_seqs, num_steps=self._num_steps,
                           num_live_tokens=self._live_tokens, block_size=s.block_size,
                           num_cached_tokens_total=s.num_prefix_hit_tokens,
                           num_prefix_query_tokens_total=s.num_prefix_query_tokens,
                           prefix_cache_hit_rate=s.num_prefix_hit_tokens
                           / max(s.num_prefix_query_tokens, 1))
