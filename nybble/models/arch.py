"""ArchSpec: what a decoder family changes in the shared pre-norm block of
:mod:`nybble.models.llama`, read from its Hugging Face config.

Every family nybble serves is the same skeleton (embedding, ``L`` blocks of attention + gated
MLP over a paged KV cache, final norm, LM head); the families differ in a handful of switches
(q/k norms, Gemma's ``(1 + w)`` norms and extra norms, soft-capping, windows, RoPE tables...).
Each family's file (:mod:`nybble.models.qwen3`, :mod:`~nybble.models.phi3`,
:mod:`~nybble.models.gemma2`, :mod:`~nybble.models.gemma3`) builds its :class:`ArchSpec`;
:mod:`nybble.models.registry` maps architecture names to them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MoESpec:
    """A family's sparse mixture-of-experts MLPs (:mod:`nybble.models.moe`).

    Attributes:
        num_experts: experts per MoE layer (``E``).
        top_k: experts each token is sent to.
        renormalize: divide the ``top_k`` router probabilities by their sum (Mixtral always;
            Qwen3-MoE when ``norm_topk_prob``).
        intermediate_size: each expert's intermediate width (``I``).
        sparse_layers: per layer, whether its MLP is the MoE block (else a dense MLP of the
            config's ``intermediate_size``).
        block: the checkpoint name of the block under ``model.layers.N`` (``mlp``,
            Mixtral's ``block_sparse_moe``); the router is ``{block}.gate``.
        projections: the checkpoint names of an expert's gate, up and down projections
            (``gate_proj``/``up_proj``/``down_proj``; Mixtral's ``w1``/``w3``/``w2``), under
            ``{block}.experts.{e}``.
        weights_in_logits_dtype: the routing weights are cast to the router logits' dtype
            before weighting the experts' outputs (Qwen3-MoE), or kept float32 (Mixtral).
    """

    num_experts: int
    top_k: int
    renormalize: bool
    intermediate_size: int
    sparse_layers: tuple[bool, ...]
    block: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    weights_in_logits_dtype: bool = False

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the MoE block."""
        return self.sparse_layers[layer]


@dataclass(frozen=True)
class ArchSpec:
    """The switches of one model (all off: a Llama).

    Attributes:
        qkv_bias, o_bias: whether the q/k/v and o projections carry a bias.
        fused_checkpoint: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` already
            fused (Phi-3) instead of q/k/v and gate/up.
        qk_norm: a per-head RMSNorm (over ``head_dim``) on q and k before RoPE (Qwen 3,
            Gemma 3).
        gemma_norm: every RMSNorm is Gemma's ``(1 + w)`` form.
        sandwich_norms: Gemma 2/3's extra norms on the attention and MLP outputs
            (``post_attention_layernorm``, ``post_feedforward_layernorm``), the pre-MLP norm
            being ``pre_feedforward_layernorm``.
        activation: the gated MLP's activation (``silu`` or ``gelu_pytorch_tanh``).
        embed_scale: multiply the embeddings by ``sqrt(hidden_size)`` (Gemma).
        attn_scale: softmax scale of q k^T; None: ``head_dim ** -0.5``.
        attn_softcap: ``c * tanh(s / c)`` on the attention scores (Gemma 2), or None.
        final_softcap: the same on the final logits (Gemma 2), or None.
        windows: per layer, the sliding window (tokens a query sees, itself included) or None
            for full attention; empty: every layer full.
        rope_params: the distinct RoPE parameter sets; empty: the config's one set.
        layer_rope: per layer, its index into ``rope_params`` (empty: all 0).
        moe: the mixture-of-experts layers (Qwen3-MoE, Mixtral), or None (every MLP dense).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    fused_checkpoint: bool = False
    qk_norm: bool = False
    gemma_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    windows: tuple[int | None, ...] = ()
    rope_params: tuple[dict[str, Any], ...] = field(default=())
    layer_rope: tuple[int, ...] = ()
    moe: MoESpec | None = None

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (tokens), or None (full attention)."""
        return self.windows[layer] if self.windows else None

    def rope_index(self, layer: int) -> int:
        """Index of layer ``layer``'s RoPE table."""
        return self.layer_rope[layer] if self.layer_rope else 0


def layer_types(config: Any) -> list[str]:
    """Each layer's ``"sliding_attention"`` / ``"full_attention"``: the config's
    ``layer_types``, else transformers' rule for files that predate it (Qwen 2/3: sliding from
    layer ``max_window_layers`` on when ``use_sliding_window``; Mistral, Phi-3: every layer
    slides when ``sliding_window`` is set)."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types:
        if len(types) != n:
            from nybble.errors import UnsupportedModelError

            raise UnsupportedModelError(f"layer_types must name {n} layers, got {len(types)}")
        return list(types)
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return ["full_attention"] * n
    first = int(getattr(config, "max_window_layers", 0) or 0) \
        if hasattr(config, "use_sliding_window") else 0
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


def sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Per layer, ``sliding_window`` for the sliding layers (:func:`layer_types`), None for the
    others; empty when no layer slides."""
    window = getattr(config, "sliding_window", None)
    types = layer_types(config)
    if not window or "sliding_attention" not in types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
