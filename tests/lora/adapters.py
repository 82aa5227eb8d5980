"""PEFT adapters built in the test (transformers' LlamaForCausalLM + peft's ``get_peft_model``,
``lora_B`` randomized so the adapter changes the outputs), saved with ``save_pretrained``, and
the transformers + PEFT oracle of their logits."""
from __future__ import annotations

import json
import os
from typing import Any

import torch


def make_adapter(base: str, folder: str, r: int, alpha: float, seed: int,
                 use_rslora: bool = False, targets: tuple[str, ...] = (
                     "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"),
                 scale: float = 0.3, **config: Any) -> str:
    """Save a LoRA adapter of ``base`` to ``folder`` (its A and B random with ``seed``;
    ``config``: more ``LoraConfig`` fields) and return the folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, use_rslora=use_rslora,
                                                  target_modules=list(targets),
                                                  lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(folder)
    return folder


def peft_logits(base: str, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]`` of transformers (+ PEFT when ``adapter``)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def peft_greedy(base: str, adapter: str | None, token_ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by transformers (+ PEFT), ``steps`` tokens, no EOS stop."""
    ids = list(token_ids)
    for _ in range(steps):
        ids.append(int(peft_logits(base, adapter, ids)[-1].argmax()))
    return ids[len(token_ids):]


def edit_config(folder: str, **changes: Any) -> str:
    """Rewrite fields of ``folder``'s adapter_config.json (for the refusal tests)."""
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return folder
