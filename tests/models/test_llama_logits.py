"""Our model's prefill logits equal transformers' (float32, 1e-4) for every architecture."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble.config import DEFAULT_MODEL, ModelConfig
from nybble.kernels.interface import AttentionMetadata
from nybble.kernels.reference_attention import TorchAttentionBackend
from nybble.models.loader import load_model

from .hf_tiny import VARIANTS, make_tiny_model

BLOCK = 16


def _prefill_logits(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run all prompts as one varlen prefill batch through a paged cache of our model."""
    loaded = load_model(ModelConfig(model=model_dir), TorchAttentionBackend(),
                        torch.device("cpu"))
    cfg = loaded.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    lens = [len(p) for p in prompts]
    blocks_per_seq = [(n + BLOCK - 1) // BLOCK for n in lens]
    # Give sequences interleaved, non-contiguous blocks to exercise the block tables.
    total = sum(blocks_per_seq)
    perm = np.random.default_rng(0).permutation(total)
    tables, k = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[k:k + nb].tolist())
        k += nb
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [tables[i][j // BLOCK] * BLOCK + j % BLOCK for i, n in enumerate(lens)
             for j in range(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(
            np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(lens), max_seq_len=max(lens), is_decode_only=False)
    caches = [torch.zeros(2, total, BLOCK, kv_heads, head_dim) for _ in range(cfg.num_hidden_layers)]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([j for n in lens for j in range(n)])
    with torch.no_grad():
        hidden = loaded.model(ids, positions, caches, meta)
        logits = loaded.model.compute_logits(hidden)
    return list(logits.split(lens))


def _hf_logits(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 40)), [1] + list(range(100, 117)), [7]]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_transformers(variant: str, tmp_path) -> None:
    path = make_tiny_model(variant, str(tmp_path))
    ours = _prefill_logits(path, PROMPTS)
    ref = _hf_logits(path, PROMPTS)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_bundled_model_logits_match_transformers() -> None:
    ours = _prefill_logits(DEFAULT_MODEL, PROMPTS)
    ref = _hf_logits(DEFAULT_MODEL, PROMPTS)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
