"""GGUF files of Qwen3, Phi-3, Gemma 2, Gemma 3 (text), Qwen3-MoE and Mixtral, written as
llama.cpp's converter writes them (:mod:`tests.gguf.write_families`; F32 and Q8_0), served by
nybble: prefill logits equal the reference within 1e-4 (float32) and greedy tokens through the
engine equal it. The reference is the transformers model the file was written from; for Q8_0
its weights are replaced by gguf-py's dequantization of the file's blocks. transformers' own
GGUF loader drops keys these tiny files need (qwen3 ``key_length``, qwen3moe
``expert_feed_forward_length``, Gemma's soft-capping / window pattern / local RoPE base, Phi-3's
rope factors, Mixtral's experts under ``llama``), so it is checked only on Qwen3 / Qwen3-MoE
variants with its default widths. Breaking the llama q/k permutation or the Gemma norm offset
fails these tests (tried)."""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
import torch

from nybble import SamplingParams
from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.gguf_loader import expert_index
from nybble.models.loader import load_model
from nybble.models.moe import MoEBlock
from nybble.models.scoring import prefill_logits
from nybble.quant.gguf_linear import GGUFLinear
from nybble.runtime.llm_engine import LLMEngine
from tests.models.hf_reference import hf_greedy, hf_logits
from tests.runtime.engine_helpers import assert_idle_and_clean, run_requests

from .write_families import GGUF_FAMILIES, TRANSFORMERS_GGUF, make_model, write_gguf

PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 40)), [1] + list(range(100, 117)), [7]]
TOL = 1e-4
Q8 = gguf.GGMLQuantizationType.Q8_0
CASES = [(name, q) for name in sorted(GGUF_FAMILIES) for q in (None, Q8)]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NYBBLE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{q.name if q else 'F32'}"
                                                     for n, q in CASES])
def written(request, tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    """``(family, file, reference model)``."""
    name, qtype = request.param
    model = make_model(name)
    folder = tmp_path_factory.mktemp(name)
    path = write_gguf(model, os.path.join(folder, f"{name}.gguf"), GGUF_FAMILIES[name][0],
                      qtype)
    return name, path, model


def _load(path: str):  # type: ignore[no-untyped-def]
    return load_model(ModelConfig(model=path, dtype="float32", device="cpu",
                                  cpu_activation_dtype="float32"),
                      TorchAttentionBackend(), torch.device("cpu"))


def test_prefill_logits_match_the_reference(written) -> None:
    _, path, hf = written
    loaded = _load(path)
    for ours, ids in zip(prefill_logits(loaded, PROMPTS), PROMPTS):
        torch.testing.assert_close(ours, hf_logits(hf, ids), atol=TOL, rtol=0)
    quantized = [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]
    assert bool(quantized) == ("Q8_0" in loaded.quant_description)
    moe = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, MoEBlock)]
    if moe and quantized:   # quantized experts stay quantized, one linear per expert
        assert all(b.w13 is None and isinstance(b.gate_up[0], GGUFLinear) for b in moe)
        assert expert_index(moe[0].gate_up[3].shard_prefixes[0]) == 3
    elif moe:               # float experts: the stacked dense form
        assert all(b.w13 is not None for b in moe)


def test_engine_greedy_tokens_match_the_reference(written) -> None:
    name, path, hf = written
    engine = LLMEngine.from_engine_args(path, max_num_batched_tokens=16, max_num_seqs=4,
                                        block_size=8, dtype="float32",
                                        cpu_activation_dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {"short": PROMPTS[0], "long": list(range(50, 80)), "mid": list(range(200, 221))}
    finals = run_requests(engine, [(k, ids, params) for k, ids in prompts.items()])
    for key, ids in prompts.items():
        assert finals[key].outputs[0].token_ids == hf_greedy(hf, ids, 8), (name, key)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_GGUF))
@pytest.mark.parametrize("qtype", [None, Q8], ids=["F32", "Q8_0"])
def test_transformers_gguf_loader_agrees(name: str, qtype, tmp_path: Path) -> None:
    """transformers' own GGUF loader on the same file (it dequantizes with gguf-py) gives
    nybble's logits: the files follow llama.cpp's layout as transformers reads it too."""
    from transformers import AutoModelForCausalLM

    model = make_model(name)
    write_gguf(model, str(tmp_path / "m.gguf"), TRANSFORMERS_GGUF[name][0], qtype)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                  dtype=torch.float32).eval()
    loaded = _load(str(tmp_path / "m.gguf"))
    for ours, ids in zip(prefill_logits(loaded, PROMPTS[:2]), PROMPTS[:2]):
        torch.testing.assert_close(ours, hf_logits(theirs, ids), atol=TOL, rtol=0)
        torch.testing.assert_close(ours, hf_logits(model, ids), atol=TOL, rtol=0)
