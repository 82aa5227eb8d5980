"""The Hugging Face baseline: ``model.generate`` over static, left-padded batches.

This is what serving looked like before iteration-level scheduling (and what vLLM's old
``benchmark_throughput.py --backend hf`` measured): requests are cut into batches of at most
``max_batch_size`` in arrival order; every batch is padded to its longest prompt and decodes
until its longest requested output, so shorter members wait (their extra tokens are generated
but not counted). Greedy decoding with ``min_new_tokens = max_new_tokens`` plays the role of
``ignore_eos``.

KV waste, sampled every decoding step through a ``StoppingCriteria`` hook: the dynamic cache is
one contiguous ``[B, L]`` block per layer (``L`` = padded prompt + tokens generated so far), so
``allocated = B * L``; a row's slots are live while the request still needs tokens
(``P_i + k - 1`` of them at step ``k``), and dead once it has its requested length.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from nybble.bench.stats import BackendResult, WasteTracker
from nybble.bench.workloads import BenchRequest

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str) -> torch.dtype:
    """``auto`` -> float32 (nybble's CPU default), else the named torch dtype."""
    return torch.float32 if dtype == "auto" else _DTYPES[dtype]


class _WasteHook:
    """A ``StoppingCriteria`` that never stops generation and records KV waste per step."""

    def __init__(self, prompt_lens: list[int], output_lens: list[int],
                 tracker: WasteTracker) -> None:
        self.prompt_lens = prompt_lens
        self.output_lens = output_lens
        self.tracker = tracker
        self.steps = 0
        self._start_len: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        # input_ids: (B, L_pad + k) after the k-th generated token; the cache holds L_pad + k - 1.
        batch, cur_len = input_ids.shape
        if self._start_len is None:
            self._start_len = cur_len - 1
        k = cur_len - self._start_len
        live = sum(p + k - 1 for p, o in zip(self.prompt_lens, self.output_lens) if k <= o)
        self.tracker.add(live, batch * (cur_len - 1))
        self.steps += 1
        return torch.zeros(batch, dtype=torch.bool, device=input_ids.device)


def load_hf_model(model_path: str, dtype: str) -> torch.nn.Module:
    """Load ``model_path`` with transformers in ``dtype`` (eval mode, CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype))
    return model.eval()


def _generate_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int,
                    tracker: WasteTracker) -> tuple[int, int]:
    """Generate one static batch; returns ``(output_tokens_counted, decoding_steps)``."""
    from transformers import StoppingCriteriaList

    prompt_lens = [r.prompt_len for r in batch]
    output_lens = [r.output_len for r in batch]
    width, new = max(prompt_lens), max(output_lens)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding: prompts end at the same column
        input_ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
        mask[i, width - r.prompt_len:] = 1
    hook = _WasteHook(prompt_lens, output_lens, tracker)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id,
                             stopping_criteria=StoppingCriteriaList([hook]),
                             num_beams=1, use_cache=True)
    generated = out[:, width:]  # (B, new)
    counted = sum(min(o, int(generated.shape[1])) for o in output_lens)
    return counted, hook.steps


def run_hf(model: torch.nn.Module, requests: list[BenchRequest], max_batch_size: int,
           pad_id: int = 0) -> BackendResult:
    """Run ``requests`` through HF ``generate`` in static batches of ``max_batch_size``."""
    tracker = WasteTracker()
    output_tokens = steps = 0
    start = time.perf_counter()
    for i in range(0, len(requests), max_batch_size):
        counted, n = _generate_batch(model, requests[i:i + max_batch_size], pad_id, tracker)
        output_tokens += counted
        steps += n
    elapsed = time.perf_counter() - start
    generated_total = sum(max(r.output_len for r in requests[i:i + max_batch_size])
                          * len(requests[i:i + max_batch_size])
                          for i in range(0, len(requests), max_batch_size))
    return BackendResult(
        backend="hf", elapsed_s=elapsed, num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests), output_tokens=output_tokens,
        num_steps=steps, kv_waste_mean=tracker.mean, kv_waste_peak=tracker.peak,
        extra={"num_batches": -(-len(requests) // max_batch_size),
               "tokens_generated_incl_padding_waits": generated_total,
               "kv_waste_source": "contiguous padded cache, sampled per decoding step"})
