"""ModelShape: the model's dimensions, read once from its Hugging Face config at load time.

Every consumer (the decoder's attention layers, the KV-cache planner, the engine's request
gate, the scratch cache of ``prefill_logits``) reads this one typed object instead of probing
the config for optional fields itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The dimensions of a Llama-family decoder.

    Attributes:
        num_layers: decoder layers (``num_hidden_layers``).
        num_heads: query heads per layer (``num_attention_heads``).
        num_kv_heads: key/value heads per layer (``num_key_value_heads``; defaults to
            ``num_heads`` when absent: multi-head attention, no GQA).
        head_dim: width of one head (``head_dim``; defaults to ``hidden_size // num_heads``).
        hidden_size: width of the residual stream.
        vocab_size: token ids the embedding holds; valid ids are ``[0, vocab_size)``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Read a transformers ``PretrainedConfig`` (Llama, Mistral, Qwen2 field names).

        NOTE: ``head_dim`` and ``num_key_value_heads`` are optional in these configs (older
        Llama files omit both); ``None`` or 0 means "derive it", as transformers does.
        """
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(num_layers=int(config.num_hidden_layers), num_heads=heads,
                   num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
                   hidden_size=hidden, vocab_size=int(config.vocab_size))
