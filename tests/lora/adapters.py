"""PEFT adapters built in the test (transformers' LlamaForCausalLM + peft's ``get_peft_model``,
``lora_B`` randomized so the adapter changes the outputs), saved with ``save_pretrained``, and
the transformers + PEFT oracle of their logits."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

TOL = 2e-4
"""Logprob tolerance: float32 rounding of another op order (the float32 oracle itself is
5e-5 from its float64 self on these adapters)."""


def make_adapter(base: str, folder: str, r: int, alpha: float, seed: int,
                 use_rslora: bool = False, targets: tuple[str, ...] = (
                     "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"),
                 scale: float = 0.1, **config: Any) -> str:
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


class PeftOracle:
    """transformers' LlamaForCausalLM of ``base`` in float32, with the PEFT ``adapter`` on
    top when given: the reference nybble's LoRA outputs are compared with."""

    def __init__(self, base: str, adapter: str | None) -> None:
        from peft import PeftModel
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        self.model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[len(token_ids), vocab]``."""
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0].float()

    def greedy(self, token_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
        """Greedy continuation of ``steps`` tokens (no EOS stop) and each token's logprob."""
        ids, lps = list(token_ids), []
        for _ in range(steps):
            logprobs = torch.log_softmax(self.logits(ids)[-1], -1)
            ids.append(int(logprobs.argmax()))
            lps.append(float(logprobs[ids[-1]]))
        return ids[len(token_ids):], lps


def edit_config(folder: str, **changes: Any) -> str:
    """Rewrite fields of ``folder``'s adapter_config.json (for the refusal tests)."""
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return folder


def check_against_peft(base: str, outs, loras, steps: int = 8) -> None:
    """Each output's greedy tokens equal :class:`PeftOracle`'s for its adapter (``loras[i]``:
    a ``LoRARequest`` or None for the base), and every logprob it reports (prompt and
    sampled, float32) is within :data:`TOL` of the oracle's."""
    oracles = {}
    for out, lora in zip(outs, loras):
        path = None if lora is None else lora.lora_path
        oracle = oracles.setdefault(path, PeftOracle(base, path))
        tokens, _ = oracle.greedy(list(out.prompt_token_ids), steps)
        sample = out.outputs[0]
        assert list(sample.token_ids) == tokens, (path, out.prompt)
        ids = list(out.prompt_token_ids)
        if out.prompt_logprobs is not None:     # the prefill's logits, every position
            want = torch.log_softmax(oracle.logits(ids), -1)
            for pos, top in enumerate(out.prompt_logprobs[1:]):
                for tid, lp in top.items():
                    assert abs(lp - float(want[pos, tid])) < TOL, (path, pos, tid)
        for step, (token, top) in enumerate(zip(sample.token_ids, sample.logprobs)):
            want = torch.log_softmax(oracle.logits(ids + list(sample.token_ids[:step]))[-1], -1)
            for tid, lp in top.items():
                assert abs(lp - float(want[tid])) < TOL, (path, step, tid, lp, float(want[tid]))
