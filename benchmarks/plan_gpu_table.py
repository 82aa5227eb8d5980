"""The docs' GPU table: ``nybble plan``'s figures for a 7B-shape and a 13B-shape Llama on
16, 24, 40 and 80 GiB GPUs, weights in fp16, INT8 and INT4 (GPTQ layout, group size 128),
KV cache fp16 and int8, 4096-token sequences.

The shapes are Llama-2-7B's and Llama-2-13B's ``config.json`` fields, written here (no hub
access); the checkpoint headers are the ones an fp16 / GPTQ export of those shapes has
(:func:`nybble.plan.weights.llama_gptq_tensors`), fed to the planner's own
:func:`nybble.plan.planner.plan_memory`. Prints the Markdown table that docs/memory-planner.md
holds. Run: ``python benchmarks/plan_gpu_table.py``.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE)]   # the repo root, as a script

from nybble.models.hf_config import HFConfig  # noqa: E402
from nybble.models.shape import ModelShape  # noqa: E402
from nybble.plan.planner import MemoryPlan, PlanRequest, plan_memory  # noqa: E402
from nybble.plan.weights import llama_gptq_tensors  # noqa: E402

LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
LLAMA_13B = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
             "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
MODELS = {"7B": LLAMA_7B, "13B": LLAMA_13B}
WEIGHTS = {"fp16": None, "INT8": 8, "INT4": 4}
GPUS_GIB = (16, 24, 40, 80)
SEQ_LEN = 4096


def plan_cell(config: dict, bits: int | None, gpu_gib: int, kv_cache_dtype: str) -> MemoryPlan:
    """The planner's answer for one cell of the table."""
    request = PlanRequest(gpu_memory=gpu_gib << 30, max_model_len=SEQ_LEN,
                          kv_cache_dtype=kv_cache_dtype, dtype="float16")
    return plan_memory(ModelShape.from_hf_config(HFConfig(config)),
                       llama_gptq_tensors(config, bits), config["max_position_embeddings"],
                       request, advise=False)


def _cell(plan: MemoryPlan) -> str:
    if plan.num_blocks == 0:
        return "does not fit"
    return f"{plan.num_sequences} ({plan.max_context // 1024}K)" if plan.num_sequences else \
        f"0 ({plan.max_context})"


def table() -> str:
    """The Markdown table: one row per (model, weights, KV dtype), one column per GPU."""
    head = ["model", "weights", "weight GiB", "KV cache", "KV KiB/token"] + \
        [f"{g} GiB" for g in GPUS_GIB]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, config in MODELS.items():
        for wname, bits in WEIGHTS.items():
            for kv in ("auto", "int8"):
                plans = [plan_cell(config, bits, g, kv) for g in GPUS_GIB]
                p0 = plans[0]
                row = [name, wname, f"{p0.weight_bytes / 2**30:.2f}",
                       "fp16" if kv == "auto" else kv, f"{p0.kv_bytes_per_token / 1024:.0f}"]
                lines.append("| " + " | ".join(row + [_cell(p) for p in plans]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
