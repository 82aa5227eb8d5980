"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

The model takes the flat batch of a step: ``input_ids [T]``, ``positions [T]``, one KV cache
tensor per layer (``[2, NB, BS, Hkv, D]``) and :class:`AttentionMetadata`, and returns hidden
states ``[T, hidden]``. q/k/v and gate/up are fused projections (one GEMM each); their
checkpoint shards are concatenated along the output dimension at load time.
Architecture: Touvron et al. 2023 (Llama 2); GQA (Ainslie et al. 2023); Qwen2 adds q/k/v bias.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nybble.kernels.interface import AttentionBackend, AttentionMetadata
from nybble.models.hf_config import HFConfig
from nybble.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from nybble.models.linear import LinearFactory, build_linear
from nybble.models.shape import ModelShape


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv -> RoPE -> write KV cache -> paged attention -> o_proj."""

    def __init__(self, shape: ModelShape, prefix: str, linear: LinearFactory,
                 rope: RotaryEmbedding, backend: AttentionBackend, bias: tuple[bool, bool],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = shape.hidden_size
        qkv_bias, o_bias = bias
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        qkv_names = [f"{prefix}.{p}_proj" for p in ("q", "k", "v")]
        self.qkv_proj = build_linear(linear, qkv_names, hidden,
                                     [self.q_size, self.kv_size, self.kv_size], qkv_bias,
                                     dtype, device)
        self.o_proj = build_linear(linear, [f"{prefix}.o_proj"], self.q_size, [hidden], o_bias,
                                   dtype, device)
        self.rope = rope
        self.backend = backend

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x: [T, hidden]`` -> rotated ``q [T, Hq, D]``, ``k [T, Hkv, D]`` and ``v [T, Hkv, D]``
        (views of one tensor). ``cos``/``sin``: the step's rotary rows
        (:meth:`RotaryEmbedding.lookup`)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # (T, Hq + 2 Hkv, D)
        qk_heads = self.num_heads + self.num_kv_heads
        # q and k are adjacent in the fused output: one rotation covers both.
        qk = self.rope.apply(qkv[:, :qk_heads], cos, sin)
        return qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, qk_heads:]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write this step's ``k``/``v`` into ``kv_cache`` and attend: ``[T, Hq * D]`` (before
        ``o_proj``)."""
        self.backend.reshape_and_cache(k, v, kv_cache, meta)
        out = self.backend.forward(q, kv_cache, meta, self.scale)  # (T, Hq, D)
        return out.view(q.shape[0], self.q_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x: [T, hidden]`` -> ``[T, hidden]``; writes this step's K/V into ``kv_cache``."""
        return self.o_proj(self.attend(*self.project(x, cos, sin), kv_cache, meta))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config: HFConfig, prefix: str, linear: LinearFactory,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            from nybble.errors import UnsupportedModelError

            raise UnsupportedModelError(f"hidden_act must be 'silu', got {act!r}")
        self.gate_up_proj = build_linear(linear, [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
                                         hidden, [inter, inter], bias, dtype, device)
        self.down_proj = build_linear(linear, [f"{prefix}.down_proj"], inter, [hidden], bias,
                                      dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, hidden]`` -> ``[T, hidden]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: HFConfig, shape: ModelShape, index: int,
                 linear: LinearFactory, rope: RotaryEmbedding, backend: AttentionBackend,
                 bias: tuple[bool, bool], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(shape, f"{prefix}.self_attn", linear, rope, backend,
                                        bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(config, f"{prefix}.mlp", linear, dtype, device)

    def pre_attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense work before attention: ``h: [T, hidden]`` -> ``(q, k, v)``."""
        return self.self_attn.project(self.input_layernorm(h), cos, sin)

    def post_attention(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The dense work after attention: ``o_proj``, both residuals and the MLP;
        ``attn: [T, Hq * D]`` -> the layer's output ``[T, hidden]``."""
        h = h + self.self_attn.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``h: [T, hidden]`` -> ``[T, hidden]``."""
        attn = self.self_attn.attend(*self.pre_attention(h, cos, sin), kv_cache, meta)
        return self.post_attention(h, attn)


Segment = Callable[..., Any]


def _first_segment(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    """Embedding, the step's rotary rows and layer 0 up to attention:
    ``(h, cos, sin, q, k, v)``."""
    h = model.embed_tokens(input_ids)
    cos, sin = model.rotary_emb.lookup(positions, h.dtype)
    return (h, cos, sin, *model.layers[0].pre_attention(h, cos, sin))


def _middle_segment(layer: LlamaDecoderLayer, following: LlamaDecoderLayer, h: torch.Tensor,
                    attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
    """From one layer's attention output to the next layer's ``(h, q, k, v)``."""
    h = layer.post_attention(h, attn)
    return (h, *following.pre_attention(h, cos, sin))


def _last_segment(layer: LlamaDecoderLayer, norm: RMSNorm, h: torch.Tensor,
                  attn: torch.Tensor) -> torch.Tensor:
    """The last layer after attention, then the final norm."""
    return norm(layer.post_attention(h, attn))


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM over a paged KV cache.

    Args:
        config: the Hugging Face config.
        linear: builds every projection (dense, or quantized by a quantization config).
        backend: the attention backend (torch reference or Triton).
        max_positions: rows of the RoPE table (the engine's ``max_model_len``).
        bias: whether (q/k/v, o) projections carry a bias: Llama/Mistral follow
            ``attention_bias``; Qwen2 has (True, False).
    """

    def __init__(self, config: HFConfig, linear: LinearFactory,
                 backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                 device: torch.device, bias: tuple[bool, bool] = (False, False)) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = backend
        self.shape = ModelShape.from_hf_config(config)
        self.rotary_emb = rope = RotaryEmbedding(config, self.shape.head_dim, max_positions,
                                                 device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.shape, i, linear, rope, backend, bias, dtype, device)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.segments: tuple[Segment, Segment, Segment] = (
            _first_segment, _middle_segment, _last_segment)

    def compile_segments(self) -> None:
        """``torch.compile`` (inductor) the dense segments between attentions; attention and
        the KV-cache writes stay eager (vLLM's piecewise compilation). Each segment is one
        graph shared by every layer (parameters are graph inputs) with a dynamic token count,
        so it compiles once per segment, lazily, on its first call."""
        self.segments = tuple(torch.compile(f, dynamic=True)  # type: ignore[assignment]
                              for f in (_first_segment, _middle_segment, _last_segment))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions: [T]`` (int32 or int64) -> final hidden states
        ``[T, hidden]``. Runs as segments cut at attention (see :meth:`compile_segments`);
        the rotary rows are gathered once for every layer."""
        first, middle, last = self.segments
        h, cos, sin, q, k, v = first(self, input_ids, positions)
        layers = self.layers
        final = len(layers) - 1
        for i, layer in enumerate(layers):
            attn = layer.self_attn.attend(q, k, v, kv_caches[i], meta)
            if i == final:
                return last(layer, self.norm, h, attn)
            h, q, k, v = middle(layer, layers[i + 1], h, attn, cos, sin)
        raise AssertionError("unreachable: a model has at least one layer")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [S, hidden]`` -> logits ``[S, vocab]`` (tied to the embeddings if so)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden, weight)
