"""``benchmarks/peer_smollm2.py``'s pieces: workload parsing, figures, per-token weight bytes."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file

from tests.bench.helpers import REPO


def _load(name: str) -> ModuleType:
    path = os.path.join(REPO, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


peer = _load("peer_smollm2")
wb = _load("_weight_bytes")


def test_parse_workload() -> None:
    w = peer.parse_workload("16x64")
    assert (w.streams, w.prompt_len, w.output_len, w.prefill) == (16, 16, 64, False)
    p = peer.parse_workload("prefill1450")
    assert (p.streams, p.prompt_len, p.output_len, p.prefill) == (1, 1450, 1, True)
    for bad in ("0x5", "16x", "prefill2", "x64", "prefill"):
        with pytest.raises(ValueError, match="allowed are NxM"):
            peer.parse_workload(bad)


def test_figure_prefill_is_prompt_tokens_over_ttft() -> None:
    agg = {"completed": 1, "total_input_tokens": 1450, "ttft_mean_ms": 2000.0,
           "output_throughput": 0.5}
    assert peer.figure(peer.parse_workload("prefill1450"), agg) == 725.0
    assert peer.figure(peer.parse_workload("1x256"), agg) == 0.5
    assert peer.figure(peer.parse_workload("1x256"), {**agg, "completed": 0}) == 0.0


def _folder(tmp_path: Path, tied: bool, head: bool) -> str:
    t = {"model.embed_tokens.weight": torch.zeros(10, 4),                       # 160 B
         "model.layers.0.self_attn.q_proj.qweight": torch.zeros(1, 8, dtype=torch.int32),  # 32
         "model.layers.0.self_attn.q_proj.scales": torch.zeros(1, 8, dtype=torch.float16),  # 16
         "model.layers.0.self_attn.q_proj.qzeros": torch.zeros(1, 1, dtype=torch.int32),   # 4
         "model.layers.0.self_attn.q_proj.g_idx": torch.zeros(4, dtype=torch.int32),       # 16
         "model.layers.0.input_layernorm.weight": torch.zeros(4),                          # 16
         "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 4, dtype=torch.bfloat16)}  # 16
    if head:
        t["lm_head.weight"] = torch.zeros(10, 2, dtype=torch.float16)                      # 40
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return str(tmp_path)


def test_weight_bytes_tied_counts_the_embedding_once_as_head(tmp_path: Path) -> None:
    got = wb.safetensors_weight_bytes(_folder(tmp_path, tied=True, head=False))
    assert got["linear_bytes"] == 32 + 16 + 4 + 16
    assert got["norm_bytes"] == 16 and got["g_idx_bytes"] == 16
    assert (got["head_bytes"], got["head_dtype"], got["tied"]) == (160, "F32", True)
    assert got["per_token_bytes"] == 68 + 16 + 160
    assert got["file_bytes"] == 160 + 32 + 16 + 4 + 16 + 16 + 16


def test_weight_bytes_untied_counts_the_head_not_the_table(tmp_path: Path) -> None:
    got = wb.safetensors_weight_bytes(_folder(tmp_path, tied=False, head=True))
    assert (got["head_bytes"], got["head_dtype"]) == (40, "F16")
    assert got["per_token_bytes"] == 68 + 16 + 40
    assert got["embedding_bytes"] == 160


def test_weight_bytes_without_a_head_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no output head"):
        wb.safetensors_weight_bytes(_folder(tmp_path, tied=False, head=False))


def test_weight_bytes_quantized_head_counts_its_tensors(tmp_path: Path) -> None:
    """GPTQModel's lm_head: true (nybble quantize --quantize-lm-head): the head is its packed
    tensors, not the float table, and not counted twice among the projections."""
    folder = _folder(tmp_path, tied=False, head=False)
    from safetensors.torch import load_file
    t = load_file(str(tmp_path / "model.safetensors"))
    t["lm_head.qweight"] = torch.zeros(1, 10, dtype=torch.int32)                    # 40 B
    t["lm_head.scales"] = torch.zeros(1, 10, dtype=torch.float16)                   # 20
    t["lm_head.g_idx"] = torch.zeros(4, dtype=torch.int32)                          # not counted
    save_file(t, str(tmp_path / "model.safetensors"))
    got = wb.safetensors_weight_bytes(folder)
    assert (got["head_bytes"], got["head_dtype"]) == (60, "quantized I32")
    assert got["linear_bytes"] == 68 and got["per_token_bytes"] == 68 + 16 + 60
