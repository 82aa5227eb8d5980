"""Qwen3-MoE and Mixtral with their experts on the Triton fused-MoE kernel give transformers'
logits (the interpreter on CPU with the dispatcher sent to Triton, native on CUDA), and on
CUDA the engine gives transformers' greedy tokens."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble import SamplingParams
from nybble.config import ModelConfig
from nybble.kernels import moe_ops
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.kernels.triton import fused_moe
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.runtime.llm_engine import LLMEngine
from tests.models.hf_moe import make_moe_model
from tests.runtime.engine_helpers import run_requests

pytestmark = [pytest.mark.triton_interpret]

PROMPTS = [[1, 403, 407, 261, 378], list(range(3, 30)), [7]]


def _hf(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_model_on_the_triton_kernel_matches_transformers(name, tmp_path, device,
                                                         monkeypatch) -> None:
    path = make_moe_model(name, str(tmp_path))
    calls: list[int] = []
    kernel = fused_moe.fused_experts

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return kernel(*args, **kwargs)
    monkeypatch.setattr(moe_ops, "_use_triton", lambda x: True)
    monkeypatch.setattr(fused_moe, "fused_experts", counted)
    loaded = load_model(ModelConfig(model=path, dtype="float32"), TorchAttentionBackend(),
                        device)
    hf = _hf(path)
    for ours, ids in zip(prefill_logits(loaded, PROMPTS), PROMPTS):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours.cpu(), want, atol=1e-4, rtol=0)
    assert calls   # the experts ran on the kernel


@pytest.mark.gpu
def test_engine_on_cuda_greedy_matches_transformers(tmp_path) -> None:
    path = make_moe_model("qwen3-moe", str(tmp_path))
    hf = _hf(path)
    engine = LLMEngine.from_engine_args(path, device="cuda", dtype="float32",
                                        max_num_batched_tokens=16, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = {"long": list(range(50, 80)), "short": [1, 403, 407]}
    finals = run_requests(engine, [(k, ids, params) for k, ids in prompts.items()])
    for key, ids in prompts.items():
        out = list(ids)
        with torch.no_grad():
            for _ in range(6):
                out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
        assert finals[key].outputs[0].token_ids == out[len(ids):], key
