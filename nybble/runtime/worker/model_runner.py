"""Turns a :class:`ScheduledBatch` (numpy) into tensors, runs the model, samples.

No Python loop over tokens, no new tensor per step for the inputs: on the CPU each array is
shared with the scheduler's buffer, on a GPU it fills a slice of a persistent buffer
(:class:`StepInputs`). A decode step samples every hidden row as it is (no gather), and an
all-greedy batch costs one argmax. On CUDA, decode steps replay CUDA graphs
(:class:`DecodeGraphs`) unless ``enforce_eager``; ``compilation_level`` 3 compiles the model's
dense segments (:meth:`LlamaForCausalLM.compile_segments`).
The runner owns everything torch-side of a step: the model, the KV caches, and the sampling
state of every live sequence (a :class:`SamplingTable`: rows added when the engine core admits
a request, dropped when a sequence finishes; a :class:`LogitShaping` row for the sequences that
use logit bias, penalties, min_tokens, bad words, allowed ids or a grammar). Results leave as
numpy arrays.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from nybble.config import EngineConfig
from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.kv_quant import as_bytes
from nybble.models.loader import LoadedModel
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.worker.cuda_graphs import DecodeGraphs, capture_sizes
from nybble.runtime.worker.draft_proposer import DraftProposer, decode_rows_metadata
from nybble.runtime.worker.host_memory import release_free_heap, retain_freed_memory
from nybble.runtime.worker.kv_cache import allocate_kv_cache
from nybble.runtime.worker.kv_plan import KVCacheSpec
from nybble.runtime.worker.lora_manager import LoRAManager
from nybble.runtime.sample.logit_shaping import LogitShaping
from nybble.runtime.messages import EngineCoreRequest
from nybble.runtime.worker.prompt_logprobs import PromptLogprobsChunk, PromptLogprobsTracker
from nybble.runtime.sample.rejection_sampler import rejection_sample
from nybble.runtime.sample.sampler import sample
from nybble.runtime.sample.sampling_table import SamplingTable
from nybble.runtime.sample.shaping_rows import VerifyLayout
from nybble.runtime.worker.step_inputs import StepInputs
from nybble.runtime.worker.weight_pages import place_weights_on_huge_pages
from nybble.runtime.sample.structured_output import GrammarMatcher
from nybble.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's sampled tokens, ``S`` rows in the order of ``batch.sample_rows``.

    A speculative step (``counts`` set) emits ``counts[r]`` tokens for row ``r``: then
    ``token_ids`` is ``int32[S, W]`` and the logprob arrays gain the same ``W`` axis after
    ``S`` (see :class:`~nybble.runtime.sample.rejection_sampler.VerifyOutput`).

    Attributes:
        token_ids: ``int32[S]`` sampled ids.
        logprobs: ``float32[S]`` log-probability of each sampled id under the raw logits,
            or ``None`` when no row asked for logprobs.
        top_token_ids, top_logprobs: ``int64[S, k]`` / ``float32[S, k]``, the ``k`` most
            likely ids of each row (``k``: the largest ``logprobs`` asked for), or ``None``.
        grammar_ended: sequence ids whose grammar ended with this step's token (structured
            output): the engine core finishes them.
        prompt_logprobs: the prompt logprobs scored in this step (one chunk per sequence
            that asked and had prompt positions in the batch), or ``None``.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None
    top_token_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    grammar_ended: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsChunk] | None = None
    counts: np.ndarray | None = None

    def select(self, keep: np.ndarray) -> ModelRunnerOutput:
        """The rows where ``keep`` (``bool[S]``) is true (the per-sequence fields are
        kept whole)."""
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[keep]
        return ModelRunnerOutput(self.token_ids[keep], pick(self.logprobs),
                                 pick(self.top_token_ids), pick(self.top_logprobs),
                                 self.grammar_ended, self.prompt_logprobs)


def _place_weights(model: torch.nn.Module, what: str) -> None:
    """Move the CPU model's streamed weights onto 2 MiB pages and log what happened."""
    moved, huge = place_weights_on_huge_pages(model)
    if moved:
        logger.info("CPU weights of the %s on 2 MiB pages: %.1f MiB copied, %.1f MiB backed "
                    "by huge pages (NYBBLE_CPU_HUGE_PAGES=0 keeps 4 KiB pages)", what,
                    moved / 2**20, huge / 2**20)


def _host(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


class ModelRunner:
    """Owns the model, the per-layer KV caches and the per-sequence sampling state.

    Args:
        loaded: the loaded model.
        spec: the KV pool to allocate.
        device: where the model and cache live.
        config: the engine configuration (seed, step limits, speculative decoding).
        proposer: the draft model of speculative decoding (``None``: none, or n-gram).
        lora: the LoRA adapters and device slots (``None``: LoRA off); each step tells the
            model which slot every token row uses.
    """

    def __init__(self, loaded: LoadedModel, spec: KVCacheSpec, device: torch.device,
                 config: EngineConfig, proposer: DraftProposer | None = None,
                 lora: LoRAManager | None = None) -> None:
        self.model = loaded.model
        self.lora = lora
        self.spec = spec
        self.device = device
        if device.type == "cpu":
            # before malloc keeps what it frees: the weights' old copies go back to the OS
            _place_weights(self.model, "model")
            if proposer is not None and proposer.model is not self.model:
                _place_weights(proposer.model, "draft model")
            release_free_heap()
            retain_freed_memory()
        self.kv_caches = allocate_kv_cache(spec, device)
        self.generator = torch.Generator(device=device).manual_seed(config.model_config.seed)
        self.sampling = SamplingTable(loaded.shape.vocab_size, device)
        self.shaping = LogitShaping(loaded.shape.vocab_size, device)
        self.prompt_logprobs = PromptLogprobsTracker()
        self.speculative = config.speculative_config is not None
        self.proposer = proposer
        sc, cc = config.scheduler_config, config.compilation_config
        self.inputs = StepInputs(device, sc.max_num_batched_tokens, sc.max_num_seqs,
                                 -(-loaded.max_model_len // spec.block_size))
        # The bytes of arange(max rows) as int32: a decode step's sample_rows are a prefix.
        self._arange_bytes = np.arange(max(sc.max_num_batched_tokens, sc.max_num_seqs),
                                       dtype=np.int32).tobytes()
        if cc.compilation_level == 3:
            self.model.compile_segments()
        elif device.type == "cpu" and not cc.enforce_eager and not loaded.model.layout.sharded:
            # NOTE: not under tensor parallelism: the fused step has no collectives
            how = self.model.enable_fused_cpu_decode(self.kv_caches)
            logger.info("CPU decode step: %s", how if self.model.fused_decode is not None
                        else f"the torch path, not the fused C step: {how}")
            if lora is not None and self.model.fused_decode is not None:
                logger.info("CPU decode step with LoRA: the fused C step adds each row's "
                            "adapter from the model's %d slot(s)", lora.config.max_loras)
            if proposer is not None:   # the draft model of speculative decoding too
                logger.info("CPU draft step: %s",
                            proposer.model.enable_fused_cpu_decode(proposer.kv_caches))
        # tensor parallelism: sends each step to the workers before the forward
        self.step_hook: Callable[[ScheduledBatch, torch.Tensor | None], None] | None = None
        self.graphs: DecodeGraphs | None = None
        # NOTE: no CUDA graphs under tensor parallelism: every rank must replay in lockstep
        blocker = self.model.cuda_graph_blocker() if device.type == "cuda" else None
        if blocker is not None and not cc.enforce_eager:
            logger.info("CUDA graphs off: %s", blocker)
        if device.type == "cuda" and not cc.enforce_eager and blocker is None and \
                not loaded.model.layout.sharded and \
                self.model.attention_backend.name == "triton":
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, capture_sizes(sc.max_num_seqs, cc.cuda_graph_sizes),
                self.inputs, loaded.max_model_len, capture=True)

    def add_request(self, first_seq_id: int, request: EngineCoreRequest,
                    matchers: list[GrammarMatcher] | None = None) -> None:
        """Add the sampling rows (and logit-shaping rows, if it shapes) of a request's
        ``params.num_sequences`` sequences at admission, and track its prompt when it asks
        for ``prompt_logprobs``; ``matchers``: one per sample for structured output. All or
        nothing."""
        params = request.params
        self.sampling.add(first_seq_id, params)
        try:
            self.shaping.add(first_seq_id, request, matchers)
            if params.prompt_logprobs is not None:
                self.prompt_logprobs.add(first_seq_id, request.prompt_token_ids,
                                         params.prompt_logprobs)
        except BaseException:
            self.remove_sequences(range(first_seq_id, first_seq_id + params.num_sequences))
            raise

    def add_sampling_rows(self, first_seq_id: int, params: SamplingParams) -> None:
        """Add only the sampling rows of ``params.num_sequences`` sequences (beam search:
        its parameters never shape the logits or ask for prompt logprobs)."""
        self.sampling.add(first_seq_id, params)

    def remove_sequences(self, seq_ids: Iterable[int]) -> None:
        """Drop the sampling and shaping rows (and prompt tracking) of finished or aborted
        sequences."""
        seq_ids = list(seq_ids)
        self.sampling.remove(seq_ids)
        self.shaping.remove(seq_ids)
        self.prompt_logprobs.remove(seq_ids)
        if self.proposer is not None:
            self.proposer.forget(seq_ids)

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy-on-write: duplicate KV blocks ``src[i] -> dst[i]`` in every layer."""
        src_t = self.inputs.put("copy_src", src.astype(np.int64))
        dst_t = self.inputs.put("copy_dst", dst.astype(np.int64))
        for cache in self.kv_caches:
            cache = as_bytes(cache)  # NOTE: CPU indexing does not take float8
            cache[:, dst_t] = cache[:, src_t]
        if self.proposer is not None:
            self.proposer.copy_blocks(src_t, dst_t)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata]:
        """``(input_ids [T] int32, positions [T] int64, metadata)`` of ``batch`` on the
        device; one object per field, no copy on the CPU."""
        put = self.inputs.put
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", batch.slot_mapping),
            query_start_loc=put("query_start_loc", batch.query_start_loc),
            seq_lens=put("seq_lens", batch.seq_lens),
            block_tables=put("block_tables", batch.block_tables),
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
            is_decode_only=batch.max_query_len == 1)
        return put("input_ids", batch.input_ids), put("positions", batch.positions), meta

    def _sampled_hidden(self, hidden: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
        """The rows ``batch.sample_rows`` of ``hidden``; no gather when they are every row
        in order (a decode step)."""
        rows = batch.sample_rows
        num = rows.shape[0]
        if num == hidden.shape[0] and \
                rows.astype(np.int32, copy=False).tobytes() == self._arange_bytes[:4 * num]:
            return hidden
        return hidden.index_select(0, self.inputs.put("sample_rows", rows.astype(np.int64)))

    def token_slots(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """``[T]`` int64 LoRA slot of each token row of ``batch`` (``-1``: base), or None
        when LoRA is off or no row uses an adapter."""
        return None if self.lora is None else self.lora.token_slots(batch)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch,
                token_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The step's forward alone: copy-on-write block copies, then the model; returns
        the final hidden states ``[T, hidden]`` (what a tensor-parallel worker runs).

        Args:
            batch: the step.
            token_slots: ``[T]`` int64 LoRA slot of each row (``-1``: base;
                :meth:`token_slots`), or None: no row uses an adapter.
        """
        if len(batch.copy_src):
            self._copy_blocks(batch.copy_src, batch.copy_dst)
        if self.proposer is not None:
            self.proposer.propose(batch)
        if self.model.lora is not None:
            self.model.lora.set_step(token_slots)
        if self.graphs is not None and token_slots is None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        input_ids, positions, meta = self.prepare(batch)
        if self.speculative and batch.max_query_len > 1 and \
                batch.num_tokens == batch.num_seqs + int(batch.num_draft_tokens.sum()):
            # NOTE: decode rows and their drafts only: verify them with the decode kernel
            meta = decode_rows_metadata(
                batch.slot_mapping, batch.positions, batch.block_tables,
                np.repeat(np.arange(batch.num_seqs), np.diff(batch.query_start_loc)),
                self.device)
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run one step and sample the rows ``batch.sample_rows`` with the sampling state of
        ``batch.sample_seq_ids``.

        Returns:
            :class:`ModelRunnerOutput` with ``len(batch.sample_rows)`` rows, in that order.
        """
        token_slots = self.token_slots(batch)
        if self.step_hook is not None:
            self.step_hook(batch, token_slots)
        hidden = self.forward(batch, token_slots)
        if self.speculative:    # NOTE: every step, so a seeded sample's noise is per position
            return self._verify(hidden, batch)
        prompt_logprobs = self.prompt_logprobs.compute(hidden, batch,
                                                       self.model.compute_logits)
        logits = self.model.compute_logits(self._sampled_hidden(hidden, batch))
        seq_ids = batch.sample_seq_ids
        shaped = self.shaping.apply(logits, seq_ids) if len(self.shaping) else logits
        out = sample(shaped, self.sampling.batch(seq_ids), self.generator,
                     raw_logits=None if shaped is logits else logits)
        token_ids = _host(out.token_ids).astype(np.int32)
        ended = self.shaping.accept(seq_ids, token_ids) if len(self.shaping) else []
        return ModelRunnerOutput(
            token_ids=token_ids, logprobs=_host(out.logprobs), top_token_ids=_host(out.top_ids),
            top_logprobs=_host(out.top_logprobs), grammar_ended=ended,
            prompt_logprobs=prompt_logprobs)

    def _verify(self, hidden: torch.Tensor, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Speculative step: the logits of each sample row's last token and drafts (``m + 1``
        rows), judged by the rejection-sampling rule."""
        m = batch.num_draft_tokens.astype(np.int64)
        width = m + 1
        offsets = np.repeat(np.cumsum(width) - width, width)
        rows = np.repeat(batch.sample_rows - m, width) + np.arange(int(width.sum())) - offsets
        # the draft a logits row judges is the next row's input (bonus rows: clamped, unused)
        drafts = batch.input_ids[np.minimum(rows + 1, batch.num_tokens - 1)]
        logits = self.model.compute_logits(
            hidden.index_select(0, torch.from_numpy(rows).to(self.device)))
        shaped = logits
        if len(self.shaping):   # NOTE: each position shaped as without speculation
            shaped = self.shaping.apply(logits, np.repeat(batch.sample_seq_ids, width),
                                        VerifyLayout.from_num_drafts(m, drafts))
        out = rejection_sample(shaped, torch.from_numpy(drafts.astype(np.int64)).to(self.device),
                               batch.num_draft_tokens, batch.positions[rows] + 1,
                               self.sampling.batch(batch.sample_seq_ids), self.generator,
                               raw_logits=None if shaped is logits else logits)
        if len(self.shaping):
            self.shaping.accept(batch.sample_seq_ids, out.token_ids, out.counts)
        if self.proposer is not None:
            self.proposer.note_verified(batch.sample_seq_ids, batch.num_draft_tokens, out.counts)
        return ModelRunnerOutput(token_ids=out.token_ids, logprobs=out.logprobs,
                                 top_token_ids=out.top_token_ids,
                                 top_logprobs=out.top_logprobs, counts=out.counts)
