"""The memory plan of a model on a GPU: weights, KV bytes per token, what fits.

The KV side is the engine's own arithmetic (:mod:`nybble.runtime.worker.kv_plan`: the budget the
engine takes from free memory, bytes per block, blocks in a budget), so ``nybble plan`` and
``nybble serve`` on a GPU of that size agree to the block. What the engine measures at
start-up (free memory after the weights) the planner derives as ``gpu_memory - weights``;
the CUDA context and allocator overhead (a few hundred MiB) are not modelled.

Tensor parallelism (``tensor_parallel_size`` > 1) is planned as ``nybble serve
--tensor-parallel-size`` runs it: each rank holds ``1/tp`` of the linear layers, embeddings and LM head and
``Hkv / tp`` KV heads (Megatron-LM's sharding; a head is replicated when ``tp > Hkv``).
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

from nybble.models.shape import ModelShape
from nybble.plan.weights import TensorInfo, weight_bytes
from nybble.runtime.worker.kv_plan import (
    KV_CACHE_DTYPES,
    KVLayout,
    blocks_in_budget,
    blocks_per_sequence,
    kv_budget_from_free,
    kv_budget_from_utilization,
    kv_element_bytes,
    kv_heads_per_rank,
)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for.

    Attributes:
        gpu_memory: bytes of one GPU.
        max_model_len: tokens of one sequence (prompt + output); ``None``: the model's limit.
        kv_cache_dtype: ``auto``, ``fp8_e4m3`` or ``int8``.
        tensor_parallel_size: GPUs the model is split over (as the engine shards it).
        dtype: serving dtype of the floating weights and an ``auto`` KV cache
            (``float16``, ``bfloat16``, ``float32``).
        block_size: tokens per KV block.
        gpu_memory_utilization: vLLM's fraction of the GPU the engine may hold, weights
            included; ``None``: the engine's default (90% of the memory free after the
            weights).
    """

    gpu_memory: int
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    dtype: str = "float16"
    block_size: int = 16
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True)
class MemoryPlan:
    """The plan for one GPU (one tensor-parallel rank).

    Attributes:
        request: what was asked.
        weight_bytes: bytes of the weights on this GPU.
        kv_bytes_per_token: KV-cache bytes of one token (all layers, K and V).
        kv_budget: bytes the engine would give the KV pool.
        num_blocks, pool_tokens: KV blocks in that budget, and the tokens they hold.
        max_model_len: the sequence length planned for (tokens).
        num_sequences: sequences of ``max_model_len`` tokens that fit at once.
        max_context: the longest single sequence the pool holds, capped by the model's
            position limit (tokens).
        advice: what to change when no sequence fits (empty otherwise).
    """

    request: PlanRequest
    weight_bytes: int
    kv_bytes_per_token: int
    kv_budget: int
    num_blocks: int
    pool_tokens: int
    max_model_len: int
    num_sequences: int
    max_context: int
    advice: tuple[str, ...] = ()


def kv_layout(shape: ModelShape, request: PlanRequest) -> KVLayout:
    """The KV pool's byte geometry on one rank for ``request`` (KV dtype, tensor parallelism,
    block size).

    Raises:
        ValueError: an unknown KV dtype, or a ``tensor_parallel_size`` that does not divide
            the KV heads (nor they it).
    """
    return KVLayout(shape.num_layers,
                    kv_heads_per_rank(shape.num_kv_heads, request.tensor_parallel_size),
                    shape.head_dim, kv_element_bytes(request.kv_cache_dtype, request.dtype),
                    request.block_size)


def plan_memory(shape: ModelShape, tensors: dict[str, TensorInfo], model_limit: int,
                request: PlanRequest, advise: bool = True) -> MemoryPlan:
    """Plan ``request`` for a model of ``shape`` whose checkpoint holds ``tensors``.

    Args:
        shape: the model's dimensions.
        tensors: its checkpoint's tensors (:func:`nybble.plan.weights.checkpoint_tensors`).
        model_limit: its position limit (``max_position_embeddings``, tokens).
        request: GPU size, sequence length, KV dtype, tensor parallelism.
        advise: compute ``advice`` when nothing fits (it plans the alternatives).

    Raises:
        ValueError: ``max_model_len`` over ``model_limit`` or < 1, an unknown KV dtype, or a
            ``tensor_parallel_size`` that does not divide the KV heads (nor they it).
    """
    max_len = request.max_model_len or model_limit
    if not 1 <= max_len <= model_limit:
        raise ValueError(f"max_model_len must be in [1, {model_limit}] (the model's position "
                         f"limit), got {max_len}")
    tp = request.tensor_parallel_size
    layout = kv_layout(shape, request)
    weights = weight_bytes(tensors, request.dtype, tp)
    free = request.gpu_memory - weights
    budget = (kv_budget_from_free(free) if request.gpu_memory_utilization is None else
              kv_budget_from_utilization(free, request.gpu_memory,
                                         request.gpu_memory_utilization))
    blocks = blocks_in_budget(budget, layout)
    seqs = blocks // blocks_per_sequence(max_len, request.block_size)
    plan = MemoryPlan(request, weights, layout.bytes_per_token, budget, blocks,
                      blocks * request.block_size, max_len, seqs,
                      min(blocks * request.block_size, model_limit))
    if seqs == 0 and advise:
        plan = replace(plan, advice=_advice(plan, shape, tensors, model_limit))
    return plan


def _advice(plan: MemoryPlan, shape: ModelShape, tensors: dict[str, TensorInfo],
            model_limit: int) -> tuple[str, ...]:
    """Changes that make at least one sequence fit, each with what it gives."""
    req, out = plan.request, []
    gib = 2**30
    if plan.weight_bytes >= req.gpu_memory:
        out.append(f"the weights alone ({plan.weight_bytes / gib:.2f} GiB) exceed the GPU's "
                   f"{req.gpu_memory / gib:.2f} GiB: quantize them (nybble quantize "
                   f"--bits 4 or 8) or split them over GPUs")
    elif plan.max_context > 0:
        out.append(f"lower --max-model-len to {plan.max_context} or less (one sequence of "
                   f"{plan.max_context} tokens fits)")
    if req.gpu_memory_utilization is not None and req.gpu_memory_utilization < 1:
        # NOTE: the smallest share of the GPU (hundredths, rounded up) that holds the weights
        # and one whole sequence, when the whole GPU does
        need = plan.weight_bytes + blocks_per_sequence(plan.max_model_len, req.block_size) * \
            req.block_size * plan.kv_bytes_per_token
        share = math.ceil(need / req.gpu_memory * 100) / 100
        if req.gpu_memory_utilization < share <= 1:
            out.append(f"--gpu-memory-utilization {share:.2f} or more: the weights and one "
                       f"sequence of {plan.max_model_len} tokens fit")
    for kv_dtype in (d for d in KV_CACHE_DTYPES if d not in ("auto", "float32")):
        if req.kv_cache_dtype == "auto":
            alt = plan_memory(shape, tensors, model_limit, replace(req, kv_cache_dtype=kv_dtype),
                              advise=False)
            if alt.num_sequences:
                out.append(f"--kv-cache-dtype {kv_dtype}: {alt.num_sequences} sequence(s) of "
                           f"{alt.max_model_len} tokens fit")
    for tp in (2, 4, 8):
        if tp <= req.tensor_parallel_size:
            continue
        try:
            alt = plan_memory(shape, tensors, model_limit,
                              replace(req, tensor_parallel_size=tp), advise=False)
        except ValueError:
            continue
        if alt.num_sequences:
            out.append(f"--tensor-parallel-size {tp}: {alt.num_sequences} sequence(s) fit per "
                       f"GPU set")
            break
    out.append(f"a GPU with more memory: each token of context needs "
               f"{plan.kv_bytes_per_token} bytes of KV cache")
    return tuple(out)


def format_plan(plan: MemoryPlan, model: str, defaults: Collection[str] = ()) -> str:
    """The plan as the lines ``nybble plan`` prints; each flag named in ``defaults`` (``model``,
    ``--gpu-memory``, ``--kv-cache-dtype``, ``--max-model-len``) was left at its default, and
    its line says so and names the flag."""
    req, gib, mib = plan.request, 2**30, 2**20

    def default(flag: str, what: str = "default") -> str:
        return f" ({what}; set with {flag})" if flag in defaults else ""

    gain = kv_element_bytes("auto", req.dtype) / kv_element_bytes(req.kv_cache_dtype, req.dtype)
    lines = [
        f"model            {model}" + (" (default: the bundled model)" if "model" in defaults
                                            else ""),
        f"GPU memory       {req.gpu_memory / gib:.2f} GiB"
        + (f" x {req.tensor_parallel_size} (tensor parallel, per-GPU figures below)"
           if req.tensor_parallel_size > 1 else "") + default("--gpu-memory"),
        f"weights          {plan.weight_bytes} bytes ({plan.weight_bytes / gib:.3f} GiB, "
        f"floating tensors as {req.dtype})",
        f"KV cache dtype   {req.kv_cache_dtype}"
        + (f" ({req.dtype})" if req.kv_cache_dtype == "auto" else
           f"{' (per-head scales)' if req.kv_cache_dtype in ('int8', 'fp8_e4m3') else ''}: "
           f"{gain:.2f}x the tokens of a {req.dtype} cache") + default("--kv-cache-dtype"),
        f"KV per token     {plan.kv_bytes_per_token} bytes "
        f"({plan.kv_bytes_per_token / 1024:.1f} KiB)",
        f"KV budget        {plan.kv_budget} bytes ({plan.kv_budget / mib:.1f} MiB: "
        + ("90% of the memory left after the weights" if req.gpu_memory_utilization is None
           else f"{req.gpu_memory_utilization:g} of the GPU less the weights") + ")",
        f"KV pool          {plan.num_blocks} blocks x {req.block_size} tokens = "
        f"{plan.pool_tokens} tokens",
        f"sequences        {plan.num_sequences} of {plan.max_model_len} tokens fit at once"
        + default("--max-model-len", "the model's max_position_embeddings"),
        f"longest context  {plan.max_context} tokens for one sequence (the most "
        f"--max-model-len can be here)",
    ]
    if plan.advice:
        lines.append("nothing fits; to change:")
        lines += [f"  - {a}" for a in plan.advice]
    return "\n".join(lines)
