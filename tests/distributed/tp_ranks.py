"""Helpers of the tensor-parallel tests: run the model's prefill logits on N gloo ranks (one
process each, loopback), and build tiny random Llama (GQA) / Qwen2 (q/k/v bias) folders."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import torch

from nybble.config import DEFAULT_MODEL

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json")


def run_rank(model: str, rank: int, world: int, init_method: str, out: str,
             sequences: list[list[int]]) -> None:
    """One rank: load the shard, compute ``prefill_logits``; rank 0 saves them to ``out``."""
    from nybble.config import ModelConfig
    from nybble.distributed import channel
    from nybble.distributed.comm import destroy_tp_group, init_tp_group
    from nybble.kernels import get_attention_backend
    from nybble.models.loader import load_model
    from nybble.models.scoring import prefill_logits

    torch.set_num_threads(1)
    tp = init_tp_group(rank, world, init_method, torch.device("cpu"), timeout_s=60)
    loaded = load_model(ModelConfig(model=model, cpu_activation_dtype="float32"),
                        get_attention_backend("torch", tp.device), tp.device, tp)
    if rank != 0:   # a worker's share of compute_logits: rank 0's LOGITS command
        def worker_logits(hidden: torch.Tensor) -> torch.Tensor:
            cmd = channel.receive(tp, lambda: True)
            assert cmd is not None and cmd.kind == channel.Kind.LOGITS
            loaded.model.worker_logits(cmd.payload.view(-1, hidden.shape[-1]))
            return hidden
        loaded.model.compute_logits = worker_logits
    logits = prefill_logits(loaded, sequences)
    if rank == 0:
        torch.save(logits, out)
    destroy_tp_group()


def tp_prefill_logits(model: str, sequences: list[list[int]], world: int,
                      tmp: str) -> list[torch.Tensor]:
    """``prefill_logits`` of ``model`` split over ``world`` gloo ranks (subprocesses)."""
    from nybble.runtime.executor.tp_executor import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    out = os.path.join(tmp, "logits.pt")
    seqs = ";".join(",".join(map(str, s)) for s in sequences)
    procs = [subprocess.Popen([sys.executable, __file__, model, str(r), str(world), init, out,
                               seqs]) for r in range(world)]
    codes = [p.wait(180) for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes}"
    return torch.load(out)


def tiny_model(tmp: str, arch: str, kv_heads: int, seed: int = 0) -> str:
    """A random-weights ``arch`` (``llama`` or ``qwen2``) folder: hidden 64, 4 heads,
    ``kv_heads`` KV heads, 2 layers, vocabulary 512 (the bundled tokenizer's)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = cfg_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=512,
                     max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():   # larger weights than the 0.02 init: clear argmax margins
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif arch == "qwen2" and p.dim() == 1 and p.shape[0] != 64:
                p.normal_(0, 0.5)     # the q/k/v biases
    path = os.path.join(tmp, f"{arch}-kv{kv_heads}")
    model.save_pretrained(path, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        src = os.path.join(DEFAULT_MODEL, name)
        if os.path.exists(src):
            shutil.copy(src, path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("model", "rank", "world", "init", "out", "seqs"):
        parser.add_argument(name)
    a = parser.parse_args()
    run_rank(a.model, int(a.rank), int(a.world), a.init, a.out,
             [[int(t) for t in s.split(",")] for s in a.seqs.split(";")])
