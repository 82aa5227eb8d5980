"""The decoder of every family nybble serves (Llama, Mistral, Qwen 2/3, Phi-3, Gemma 2/3,
Qwen3-MoE and Mixtral, whose sparse layers' MLP is :class:`nybble.models.moe.MoEBlock`) over
a paged KV cache; what a family changes comes from its :class:`~nybble.models.arch.ArchSpec`.

The model takes the flat batch of a step: ``input_ids [T]``, ``positions [T]``, one KV cache
tensor per layer (``[2, NB, BS, Hkv, D]``) and :class:`AttentionMetadata`, and returns hidden
states ``[T, hidden]``. q/k/v and gate/up are fused projections (one GEMM each); their
checkpoint shards are concatenated along the output dimension at load time.
Architecture: Touvron et al. 2023 (Llama 2); GQA (Ainslie et al. 2023); Qwen2 adds q/k/v bias;
the other families' differences are described in their files (:mod:`nybble.models.qwen3`,
:mod:`~nybble.models.phi3`, :mod:`~nybble.models.gemma2`, :mod:`~nybble.models.gemma3`).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from nybble.distributed import channel
from nybble.distributed.comm import single_rank
from nybble.kernels.interface import AttentionBackend, AttentionMetadata
from nybble.kernels.kv_quant import KeySmoothing, RotaryKeys
from nybble.models.cpu_fused import FusedCpuDecode, dense_head
from nybble.errors import UnsupportedModelError
from nybble.models.arch import ArchSpec
from nybble.models.hf_config import HFConfig
from nybble.models.layer_ops import (
    EAGER_SEGMENTS,
    LayerOps,
    ModelOps,
    Segments,
    post_attention,
    pre_attention,
    run_step,
)
from nybble.models.layers import GATED_ACTIVATIONS, GemmaRMSNorm, RMSNorm, RotaryEmbedding
from nybble.models.linear import LinearFactory, as_function, build_linear
from nybble.models.moe import MoEBlock
from nybble.models.lora import LoRASlots
from nybble.lora_files import BaseTargets
from nybble.models.shape import ModelShape
from nybble.models.tp_layout import TPLayout


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv -> (per-head q/k norm) -> RoPE -> write KV cache -> paged
    attention (sliding window, soft-capping when the family has them) -> o_proj (the step
    runs it through :mod:`nybble.models.layer_ops`)."""

    def __init__(self, shape: ModelShape, prefix: str, linear: LinearFactory,
                 rope: RotaryEmbedding, backend: AttentionBackend, spec: ArchSpec,
                 layer: int, eps: float, dtype: torch.dtype, device: torch.device,
                 layout: TPLayout, max_positions: int) -> None:
        super().__init__()
        hidden = shape.hidden_size
        self.num_heads = layout.num_heads          # this rank's heads (all of them at TP 1)
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim ** -0.5
        qkv_names = ([f"{prefix}.qkv_proj"] if spec.fused_checkpoint else
                     [f"{prefix}.{p}_proj" for p in ("q", "k", "v")])
        self.qkv_proj = build_linear(linear, qkv_names, hidden,
                                     [self.q_size, self.kv_size, self.kv_size], spec.qkv_bias,
                                     dtype, device)
        self.o_proj = build_linear(linear, [f"{prefix}.o_proj"], self.q_size, [hidden],
                                   spec.o_bias, dtype, device)
        if layout.sharded:
            self.qkv_proj.tp_slices = [layout.q, layout.kv, layout.kv]
            self.o_proj.tp_slices = [layout.o_in]
        norm = GemmaRMSNorm if spec.gemma_norm else RMSNorm
        self.q_norm = norm(self.head_dim, eps, dtype, device) if spec.qk_norm else None
        self.k_norm = norm(self.head_dim, eps, dtype, device) if spec.qk_norm else None
        self.rope = rope
        self.rope_index = spec.rope_index(layer)
        self.backend = backend
        window = spec.window(layer)
        # NOTE: a window that covers every position the engine allows is no window at all
        self.window = window if window is not None and window < max_positions else None
        self.softcap = spec.attn_softcap
        self._extra = {k: v for k, v in (("window", self.window), ("softcap", self.softcap))
                       if v is not None}
        # [2, Hkv] float32 per-head K/V scales of a quantized KV cache (set by
        # nybble.runtime.worker.kv_calibration before the pool is used); None for a float cache.
        self.kv_scale: torch.Tensor | None = None
        # its per-channel key centring and scale migration (set with kv_scale), or None
        self.key_smoothing: KeySmoothing | None = None
        # the zero point and rotary table of keys cached before RoPE (set with kv_scale when
        # the quantized cache holds pre-RoPE keys), or None
        self.rotary_keys: RotaryKeys | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata,
               keys_before_rope: bool = False) -> torch.Tensor:
        """Write this step's ``k``/``v`` ``[T, Hkv, D]`` into ``kv_cache`` and attend with
        ``q [T, Hq, D]``: ``[T, Hq * D]`` (before ``o_proj``). ``k`` is rotated, or before
        RoPE when the layer's quantized cache holds keys before RoPE (``rotary_keys`` set:
        :func:`nybble.models.layer_ops.pre_attention` leaves them unrotated, and says so with
        ``keys_before_rope``).

        Raises:
            RuntimeError: ``keys_before_rope`` disagrees with the layer (the model's ops were
                built before ``rotary_keys`` changed: :meth:`LlamaForCausalLM.drop_ops`).
        """
        if keys_before_rope != (self.rotary_keys is not None):
            raise RuntimeError("the step's keys are " + ("before" if keys_before_rope else
                               "after") + " RoPE but the layer's cache expects the other: "
                               "call drop_ops() after changing rotary_keys")
        extra = self._extra
        if self.key_smoothing is not None:
            if self.rotary_keys is not None:
                # NOTE: ``k`` is before RoPE (pre_attention): the kernels rotate as they read
                extra = {**extra, "rotary_keys": self.rotary_keys}
            q, k = self.key_smoothing.queries(q), self.key_smoothing.keys(k)
        self.backend.reshape_and_cache(k, v, kv_cache, meta, self.kv_scale)
        out = self.backend.forward(q, kv_cache, meta, self.scale, self.kv_scale,
                                   **extra)  # (T, Hq, D)
        return out.view(q.shape[0], self.q_size)


class LlamaMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU-tanh for Gemma) with a fused gate/up projection
    (run by :func:`nybble.models.layer_ops.post_attention`)."""

    def __init__(self, config: HFConfig, prefix: str, linear: LinearFactory, spec: ArchSpec,
                 dtype: torch.dtype, device: torch.device, layout: TPLayout) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, layout.inter.length
        bias = bool(getattr(config, "mlp_bias", False))
        act = spec.activation if spec.gemma_norm else getattr(config, "hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act must be one of "
                                        f"{', '.join(GATED_ACTIVATIONS)}, got {act!r}")
        self.act = GATED_ACTIVATIONS[act]
        names = ([f"{prefix}.gate_up_proj"] if spec.fused_checkpoint else
                 [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.gate_up_proj = build_linear(linear, names, hidden, [inter, inter], bias, dtype,
                                         device)
        self.down_proj = build_linear(linear, [f"{prefix}.down_proj"], inter, [hidden], bias,
                                      dtype, device)
        if layout.sharded:
            self.gate_up_proj.tp_slices = [layout.inter, layout.inter]
            self.down_proj.tp_slices = [layout.down_in]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block: ``h += attn(norm(h)); h += mlp(norm(h))``; with Gemma's
    sandwich norms ``h += norm(attn(norm(h))); h += norm(mlp(norm(h)))``."""

    def __init__(self, config: HFConfig, shape: ModelShape, index: int,
                 linear: LinearFactory, ropes: list[RotaryEmbedding],
                 backend: AttentionBackend, spec: ArchSpec, dtype: torch.dtype,
                 device: torch.device, layout: TPLayout, max_positions: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.tp = layout.tp     # o_proj and down_proj outputs are all-reduced over it
        eps = config.rms_norm_eps
        norm = GemmaRMSNorm if spec.gemma_norm else RMSNorm
        hidden = config.hidden_size
        self.input_layernorm = norm(hidden, eps, dtype, device)
        self.self_attn = LlamaAttention(shape, f"{prefix}.self_attn", linear,
                                        ropes[spec.rope_index(index)], backend, spec, index,
                                        eps, dtype, device, layout, max_positions)
        # Llama: the pre-MLP norm; Gemma: the norm of the attention output
        self.post_attention_layernorm = norm(hidden, eps, dtype, device)
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = norm(hidden, eps, dtype, device)
            self.post_feedforward_layernorm = norm(hidden, eps, dtype, device)
        self.sandwich = spec.sandwich_norms
        self.mlp: LlamaMLP | MoEBlock
        if spec.moe is not None and spec.moe.is_sparse(index):
            self.mlp = MoEBlock(spec.moe, f"{prefix}.{spec.moe.block}", hidden, linear,
                                getattr(config, "hidden_act", "silu"), dtype, device,
                                layout.expert_inter if layout.sharded else None,
                                layout.expert_down_in if layout.sharded else None)
        else:
            self.mlp = LlamaMLP(config, f"{prefix}.mlp", linear, spec, dtype, device, layout)

    def forward(self, h: torch.Tensor, rot: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``h: [T, hidden]`` -> ``[T, hidden]`` (one layer alone; ``rot``: the step's
        ``(cos, sin)`` of each RoPE table; the model's step runs every layer through
        :mod:`nybble.models.layer_ops` instead)."""
        ops = LayerOps.of(self)
        attn = ops.attend(*pre_attention(ops, h, rot), kv_cache, meta)
        return post_attention(ops, h, attn)


class LlamaForCausalLM(nn.Module):
    """The causal LM of every supported family over a paged KV cache.

    Args:
        config: the Hugging Face config.
        linear: builds every projection (dense, or quantized by a quantization config).
        backend: the attention backend (torch reference or Triton).
        max_positions: rows of the RoPE table (the engine's ``max_model_len``).
        spec: what the family changes (:func:`nybble.models.registry.arch_spec`; default: a
            plain Llama).
        layout: this rank's share under tensor parallelism (:class:`TPLayout`; default:
            one rank, the whole model).

    Raises:
        UnsupportedModelError: heads or widths that do not split over the ranks, or a
            fused-checkpoint family (Phi-3) under tensor parallelism.
    """

    def __init__(self, config: HFConfig, linear: LinearFactory,
                 backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                 device: torch.device, spec: ArchSpec | None = None,
                 layout: TPLayout | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = backend
        self.shape = ModelShape.from_hf_config(config)
        self.layout = layout = layout or TPLayout.of(self.shape, config.intermediate_size,
                                                     single_rank())
        self.spec = spec = spec or ArchSpec()
        if spec.fused_checkpoint and layout.sharded:
            raise UnsupportedModelError("tensor_parallel_size must be 1 for a checkpoint with "
                                        "fused qkv_proj / gate_up_proj (Phi-3)")
        if spec.moe is not None and layout.sharded and layout.expert_inter is None:
            raise UnsupportedModelError(
                "a mixture-of-experts model under tensor parallelism needs a TPLayout built "
                "with expert_intermediate_size (TPLayout.of(..., spec.moe.intermediate_size))")
        rows = layout.vocab_rows
        head_dim = self.shape.head_dim
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(config, head_dim, max_positions, device, params)
            for params in spec.rope_params or (None,))
        self.rotary_emb = self.rotary_embs[0]
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.shape, i, linear, list(self.rotary_embs), backend,
                              spec, dtype, device, layout, max_positions)
            for i in range(config.num_hidden_layers))
        norm = GemmaRMSNorm if spec.gemma_norm else RMSNorm
        self.norm = norm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.embed_scale = float(config.hidden_size) ** 0.5 if spec.embed_scale else None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Parameter(
            torch.empty(rows, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        # quantized token embedding / output head (GGUF files): modules with ``embed_rows``
        # and ``__call__`` (``nybble.quant.gguf_linear``), replacing the float tables
        self.quant_embed: nn.Module | None = None
        self.quant_head: nn.Module | None = None
        self.segments: Segments = EAGER_SEGMENTS
        self._ops: ModelOps | None = None
        self.fused_decode: FusedCpuDecode | None = None
        # the device slots of multi-LoRA serving (enable_lora), or None
        self.lora: LoRASlots | None = None

    def lora_targets(self) -> BaseTargets:
        """The projections a LoRA adapter may adapt on this model, with their shapes."""
        s = self.shape
        return BaseTargets.of(s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads,
                              s.head_dim, int(self.config.intermediate_size))

    def enable_lora(self, max_loras: int, max_rank: int) -> LoRASlots:
        """Allocate ``max_loras`` adapter slots of rank up to ``max_rank`` and make every
        q/k/v/o and gate/up/down projection add the step's LoRA updates
        (:class:`~nybble.models.lora.LoRASlots`; call after the weights are loaded).

        Under tensor parallelism the slots hold this rank's share of each adapter
        (:class:`~nybble.models.lora.LoRASlots`).

        Raises:
            UnsupportedModelError: for a fused-checkpoint family (Phi-3: its adapters target
                ``qkv_proj`` / ``gate_up_proj``), or for a mixture-of-experts model.
        """
        if self.spec.fused_checkpoint:
            raise UnsupportedModelError("LoRA adapters are not supported on a fused-checkpoint "
                                        "family (Phi-3)")
        if self.spec.moe is not None:
            raise UnsupportedModelError("LoRA adapters are not supported on mixture-of-experts "
                                        "models (Qwen3-MoE, Mixtral); dense families only")
        weight = self.norm.weight
        self.lora = LoRASlots(self.lora_targets(), max_loras, max_rank, weight.dtype,
                              weight.device, self.layout)
        self._ops = None
        self.fused_decode = None     # NOTE: built again with the slots (enable_fused_cpu_decode)
        return self.lora

    def drop_ops(self) -> None:
        """Forget the built :meth:`ops`, so the next use reads the layers afresh (after the
        KV-cache calibration changes what their attention expects)."""
        self._ops = None

    def ops(self) -> ModelOps:
        """The model as plain callables (:class:`ModelOps`), built on first use: after the
        weights are loaded, which copies into the same parameter tensors.

        NOTE: the ops hold the parameter tensors; ``.to()``/``.half()`` (``_apply``) drop
        them, and so must any code that assigns new parameter tensors to a submodule."""
        if self._ops is None:
            embed = (self.quant_embed.embed_rows if self.quant_embed is not None else
                     vocab_embedding(self.embed_tokens.weight, self.layout, self.embed_scale))
            if self.quant_embed is not None and self.embed_scale is not None:
                rows, scale = self.quant_embed.embed_rows, self.embed_scale
                embed = lambda ids: rows(ids).mul_(scale)  # noqa: E731 (Gemma's sqrt(hidden))
            lora = self.lora
            layers = tuple(LayerOps.of(layer, None if lora is None else lora.adapt(i))
                           for i, layer in enumerate(self.layers))
            self._ops = ModelOps(embed, tuple(self.rotary_embs), layers, as_function(self.norm))
        return self._ops

    def set_quantized_vocab(self, embed: nn.Module | None, head: nn.Module | None) -> None:
        """Use a quantized token embedding (``embed.embed_rows(ids [T]) -> [T, hidden]``) and
        output head (``head(hidden [S, hidden]) -> [S, vocab]``) instead of the float tables
        (None: keep the float one). One rank only.

        Raises:
            ValueError: under tensor parallelism.
        """
        if self.layout.sharded and (embed is not None or head is not None):
            raise ValueError("a quantized embedding or head needs tensor_parallel_size 1")
        self.quant_embed, self.quant_head = embed, head
        self._ops = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._ops = None   # parameters may be new tensors after .to() / .half()
        self.fused_decode = None
        return super()._apply(fn, recurse)

    def cuda_graph_blocker(self) -> str | None:
        """Why the decode step cannot be captured in a CUDA graph, or None when it can.

        Quantized mixture-of-experts layers run their experts one by one on counts read back
        to the host (:func:`nybble.kernels.reference.moe.grouped_experts`), which a capture
        forbids; float experts run the Triton fused-MoE kernel, which reads nothing back."""
        if any(isinstance(layer.mlp, MoEBlock) and layer.mlp.w13 is None
               for layer in self.layers):
            return "quantized mixture-of-experts layers (experts sized on the host per step)"
        return None

    def enable_fused_cpu_decode(self, kv_caches: list[torch.Tensor]) -> str:
        """Run decode-only steps over ``kv_caches`` as one C call
        (:class:`nybble.models.cpu_fused.FusedCpuDecode`) when the model qualifies; returns
        what was chosen (or why not), for the log."""
        self.fused_decode, why = FusedCpuDecode.build(self, kv_caches)
        return why

    def compile_segments(self) -> None:
        """``torch.compile`` (inductor) the dense segments between attentions; attention and
        the KV-cache writes stay eager (vLLM's piecewise compilation). Each segment compiles
        on its first call, with a dynamic token count."""
        self.segments = tuple(torch.compile(f, dynamic=True)  # type: ignore[assignment]
                              for f in EAGER_SEGMENTS)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions: [T]`` (int32 or int64) -> final hidden states
        ``[T, hidden]``; writes the step's K/V into ``kv_caches`` (see
        :func:`nybble.models.layer_ops.run_step`; or the fused CPU step when it is on and takes
        this step; a step with LoRA rows only when the fused step was built with the model's
        LoRA slots)."""
        if self.fused_decode is not None and (self.lora is None or self.lora.rows is None or
                                              self.fused_decode.lora is self.lora):
            hidden = self.fused_decode(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        return run_step(self.ops(), self.segments, input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [S, hidden]`` -> logits ``[S, vocab]`` (tied to the embeddings if so;
        soft-capped when the family caps them).

        Under tensor parallelism (on rank 0) it first sends the rows to the other ranks
        (:data:`~nybble.distributed.channel.Kind.LOGITS`), each computes its vocabulary
        rows, and rank 0 gathers them."""
        if self.quant_head is not None:
            return self._softcapped(self.quant_head(hidden))
        if not self.layout.sharded:
            weight = self._head_weight()
            logits = dense_head(hidden, weight)   # a few rows of a float32 CPU head
            return self._softcapped(nn.functional.linear(hidden, weight) if logits is None
                                    else logits)
        if hidden.shape[0] == 0:    # a step that samples nothing (a prefill chunk): no command
            return hidden.new_empty(0, self.shape.vocab_size)
        channel.send(self.layout.tp, channel.Kind.LOGITS, tuple(hidden.shape), hidden)
        logits = self._logits_part(hidden)
        assert logits is not None
        vocab = self.shape.vocab_size
        logits = logits if logits.shape[-1] == vocab else logits[:, :vocab].contiguous()
        return self._softcapped(logits)

    def _softcapped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-capping ``c * tanh(logits / c)`` (in place), when it has one."""
        cap = self.spec.final_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def worker_logits(self, hidden: torch.Tensor) -> None:
        """On ranks 1..N-1: this rank's part of :meth:`compute_logits` for rank 0's
        ``hidden [S, hidden]`` rows (received from the command channel)."""
        self._logits_part(hidden)

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def _logits_part(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits ``[S, vocab_rows]``, gathered to ``[S, N * vocab_rows]`` on
        rank 0 (``None`` elsewhere)."""
        return self.layout.tp.gather_last_dim(nn.functional.linear(hidden, self._head_weight()))


def vocab_embedding(weight: torch.Tensor, layout: TPLayout, scale: float | None = None
                    ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The embedding lookup ``ids [T] -> [T, hidden]`` over this rank's rows ``weight
    [vocab_rows, hidden]``: ids of other ranks give zero rows and the all-reduce sums the
    ranks' lookups (vocabulary-parallel embedding, Megatron-LM); times ``scale`` when given
    (Gemma's ``sqrt(hidden_size)``)."""
    if scale is not None:
        lookup = vocab_embedding(weight, layout)

        def scaled(ids: torch.Tensor) -> torch.Tensor:
            return lookup(ids).mul_(scale)
        return scaled
    if not layout.sharded:
        return functools.partial(nn.functional.embedding, weight=weight)
    start, rows, tp = layout.vocab_start, layout.vocab_rows, layout.tp

    def embed(ids: torch.Tensor) -> torch.Tensor:
        local = ids.to(torch.int64) - start
        outside = (local < 0) | (local >= rows)
        h = nn.functional.embedding(local.masked_fill(outside, 0), weight)
        return tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))
    return embed
