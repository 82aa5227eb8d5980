"""Benchmark: end-to-end decode throughput of a Llama-2-7B-shaped model, fp16 vs AWQ INT4.

The model is nybble's own ``LlamaForCausalLM`` (fused qkv / gate-up, paged KV cache, the
attention backend of the device) with random weights: fp16 dense linears, or AutoAWQ GEMM
4-bit g128 linears (random packed words and fp16 scales) running the fused Triton
dequant-GEMM. Each measured step is one decode token for every sequence of the batch, at a
context of ``--context`` tokens already in the cache; the figure is generated tokens per
second (median of CUDA-event-timed steps after warm-up). Random weights: compare speeds only.

Without CUDA it runs a tiny shape on the CPU (torch backends) as a smoke test of the script.
Usage: ``python benchmarks/e2e_decode_gpu.py``; on CUDA writes
``benchmarks/results/e2e_decode.json`` (and ``$OUT/e2e_decode.json`` when ``$OUT`` is set).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from transformers import LlamaConfig

from nybble.bench.report import print_table, write_json
from nybble.kernels import get_attention_backend
from nybble.kernels.interface import AttentionMetadata
from nybble.models.linear import dense_linear_factory
from nybble.models.llama import LlamaForCausalLM
from nybble.quant.config import LayerParams, QuantConfig

CUDA = torch.cuda.is_available()
BLOCK = 16


def llama_config(tiny: bool) -> LlamaConfig:
    """Llama-2-7B geometry (or a tiny one for the CPU smoke run)."""
    if tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                           max_position_embeddings=4096)
    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096)


def build_model(cfg: LlamaConfig, quant: bool, device: torch.device) -> LlamaForCausalLM:
    """Random-weight model; ``quant``: AWQ GEMM INT4 g128 linears."""
    factory = dense_linear_factory
    if quant:
        factory = QuantConfig(method="awq", fmt="gemm",
                              params=LayerParams(bits=4, group_size=128, sym=False,
                                                 desc_act=False)).linear_factory
    backend = get_attention_backend("auto", device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg, factory, backend, cfg.max_position_embeddings, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("cos", "sin")):
            continue
        if t.dtype == torch.int32:  # packed INT4 words: any bit pattern is a valid weight
            t.copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=gen, device=device,
                                  dtype=torch.int32))
        elif name.endswith("scales"):
            t.copy_(torch.rand(t.shape, generator=gen, device=device) * 2e-3 + 1e-3)
        elif "norm" in name:
            t.fill_(1.0)
        else:
            t.copy_(torch.randn(t.shape, generator=gen, device=device) * 0.02)
    return model.eval()


def decode_tokens_per_s(model: LlamaForCausalLM, cfg: LlamaConfig, batch: int, context: int,
                        steps: int, device: torch.device) -> float:
    """Median generated tokens/s over ``steps`` timed decode steps of ``batch`` sequences."""
    dtype = model.embed_tokens.weight.dtype
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    blocks_per_seq = (context + steps + 8 + BLOCK - 1) // BLOCK
    caches = [torch.randn(2, batch * blocks_per_seq, BLOCK, cfg.num_key_value_heads, head_dim,
                          dtype=dtype, device=device) * 0.1 for _ in range(cfg.num_hidden_layers)]
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32,
                          device=device).view(batch, blocks_per_seq)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    times = []
    with torch.inference_mode():
        for step in range(steps + 3):
            pos = context + step
            positions = torch.full((batch,), pos, dtype=torch.int64, device=device)
            slots = tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
            meta = AttentionMetadata(
                slot_mapping=slots,
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                seq_lens=torch.full((batch,), pos + 1, dtype=torch.int32, device=device),
                block_tables=tables, max_query_len=1, max_seq_len=pos + 1, is_decode_only=True)
            if CUDA:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            hidden = model(ids, positions, caches, meta)
            ids = model.compute_logits(hidden).argmax(-1)
            if CUDA:
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if step >= 3:  # warm-up: Triton compilation and autotuning
                times.append(ms)
    return batch / (statistics.median(times) * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if CUDA else "cpu")
    cfg = llama_config(tiny=not CUDA)
    batches = args.batches if CUDA else [1, 4]
    context = args.context if CUDA else 64
    rows = []
    for quant in (False, True):
        model = build_model(cfg, quant, device)
        weight_gib = sum(t.numel() * t.element_size() for t in
                         list(model.parameters()) + list(model.buffers())) / 2**30
        for b in batches:
            tps = decode_tokens_per_s(model, cfg, b, context, args.steps if CUDA else 3, device)
            rows.append({"weights": "awq-int4-g128" if quant else "fp16" if CUDA else "fp32",
                         "batch": b, "context": context, "weight_GiB": round(weight_gib, 2),
                         "tokens_per_s": round(tps, 1)})
        del model
        if CUDA:
            torch.cuda.empty_cache()
    dense = {r["batch"]: r["tokens_per_s"] for r in rows if not r["weights"].startswith("awq")}
    for row in rows:
        row["speedup_vs_fp"] = round(row["tokens_per_s"] / dense[row["batch"]], 2)
    title = ("end-to-end decode, Llama-2-7B shape, random weights" if CUDA else
             "end-to-end decode smoke run (tiny shape, CPU; not a measurement)")
    print_table(rows, title)
    if not CUDA:
        return  # a smoke run writes no result file
    payload = {"device": torch.cuda.get_device_name(), "rows": rows}
    write_json(os.path.join(HERE, "results", "e2e_decode.json"), payload)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "e2e_decode.json"), payload)


if __name__ == "__main__":
    main()
