"""Calibration data and layer-by-layer execution of a transformers Llama on CPU or GPU.

The model is run up to its first decoder layer once; after that every decoder layer is
processed on the recorded hidden states of all calibration sequences at once
(docs/quant-formats.md §7.3 "Driver" steps 1 and 3).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

def calibration_ids(tokenizer: Any, text: str, num_samples: int, seq_len: int,
                    bos_id: int | None) -> torch.Tensor:
    """Cut ``text`` into up to ``num_samples`` sequences of ``seq_len`` tokens.

    The text is split into paragraphs (blank-line separated: one story each in the shipped
    texts); each is tokenized with BOS in front, as the model sees a document at inference
    (no BOS when ``bos_id`` is None), the paragraphs are concatenated and the stream is cut
    into consecutive windows of ``seq_len`` (AutoAWQ's ``get_calib_dataset`` does the same
    with its samples). Text shorter than one window gives one shorter sequence.

    Returns:
        int64 ``[S, L]``.

    Raises:
        ValueError: ``num_samples < 1``, ``seq_len < 2`` or empty text.
    """
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"num_samples must be >= 1 and seq_len >= 2, got {num_samples}, "
                         f"{seq_len}")
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    # NOTE: paragraphs are encoded through the backend (no special tokens, BOS added here), so
    # the tokenizer's "longer than model_max_length" warning does not apply.
    if getattr(tokenizer, "is_fast", False):
        encoded = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(
            paras, add_special_tokens=False)]
    else:
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in paras]
    bos = [] if bos_id is None else [bos_id]
    ids = [t for e in encoded for t in bos + list(e)]
    if not any(encoded):
        raise ValueError("calibration text must contain at least one token, got none")
    length = min(seq_len, len(ids))
    n = max(1, min(num_samples, len(ids) // length))
    return torch.tensor([ids[i * length:(i + 1) * length] for i in range(n)], dtype=torch.int64)


class _Stop(Exception):
    pass


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, input_ids: torch.Tensor
                               ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states ``[S, L, H]`` entering decoder layer 0 and its keyword arguments
    (rotary ``position_embeddings``, ``attention_mask``, ``position_ids``)."""
    layers = model.model.layers
    captured: dict[str, Any] = {}

    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    kwargs = dict(captured["kwargs"])
    kwargs["use_cache"] = False
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    return captured["hidden"], kwargs


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """One decoder layer forward on all calibration sequences, ``[S, L, H] -> [S, L, H]``."""
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def attention_forward(layer: nn.Module, kwargs: dict[str, Any]
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> self_attn(x)`` of ``layer`` with the recorded rotary embeddings and mask."""
    attn_kwargs = {k: kwargs[k] for k in ("position_embeddings", "attention_mask")
                   if k in kwargs}

    def fwd(x: torch.Tensor) -> torch.Tensor:
        out = layer.self_attn(hidden_states=x, **attn_kwargs)
        return out[0] if isinstance(out, tuple) else out
    return fwd


@torch.no_grad()
def record_inputs(layer: nn.Module, names: list[str], hidden: torch.Tensor,
                  kwargs: dict[str, Any],
                  sink: Callable[[str, torch.Tensor], None] | None = None
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run ``layer`` once with hooks on the Linears ``names`` (relative to the layer).

    Returns:
        ``({name: input [S, L, K]}, layer output)``; with ``sink`` the inputs are passed to
        it instead of being kept (the dict is then empty).
    """
    feats: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        def hook(_m: nn.Module, args: tuple[Any, ...], _o: Any, name: str = name) -> None:
            if sink is not None:
                sink(name, args[0].detach())
            else:
                feats[name] = args[0].detach()
        handles.append(layer.get_submodule(name).register_forward_hook(hook))
    try:
        out = run_layer(layer, hidden, kwargs)
    finally:
        for h in handles:
            h.remove()
    return feats, out
