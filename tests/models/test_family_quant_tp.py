"""The dense families beyond Llama (Qwen3, Gemma 2, Gemma 3, Phi-3) quantized by nybble's own
GPTQ (4-bit, groups of 32) are served with logits within the dense models' bound (2e-3 on the
exact CPU path, tests/quant/test_fixture_engine_logits.py) of the oracle (transformers
carrying the quantized modules, nybble.quantize.hf_model); under tensor parallelism (2 gloo
ranks) their float logits equal one rank's, and Phi-3's fused checkpoint is refused there with
its reason, as is quantizing it."""
from __future__ import annotations

import os

import pytest
import torch

from nybble.config import ModelConfig
from nybble.kernels import get_attention_backend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.quant.linear import QuantLinear
from nybble.quantize import hf_model
from nybble.quantize.driver import QuantizeOptions, quantize_model
from tests.distributed.tp_ranks import tp_prefill_logits

from .hf_families import make_family_model

PROMPTS = [[1, 403, 407, 261, 378, 300, 301], list(range(3, 30)), [7]]
CALIB = "\n\n".join(f"Story {i}: the little dog ran to the park and saw {i} red birds "
                    f"singing in the tall green tree by the river." for i in range(60))
CPU = torch.device("cpu")


def _logits(model: str) -> list[torch.Tensor]:
    loaded = load_model(ModelConfig(model=model, dtype="float32", device="cpu",
                                    cpu_activation_dtype="float32"),
                        get_attention_backend("torch", CPU), CPU)
    return loaded, prefill_logits(loaded, PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3"])
def test_gptq_4bit_is_served_within_the_dense_bound(tmp_path, name) -> None:
    src = make_family_model(name, str(tmp_path))
    out = os.path.join(tmp_path, f"{name}-gptq")
    opts = QuantizeOptions(method="gptq", bits=4, group_size=32, calib_text=CALIB,
                           num_samples=16, seq_len=64)
    done = quantize_model(src, out, opts, progress=False)
    assert done["quantized"] and not done["skipped"]
    loaded, ours = _logits(out)
    quantized = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * loaded.model.shape.num_layers   # qkv, o, gate_up, down
    oracle = hf_model.load_model(out)
    for got, ids in zip(ours, PROMPTS):
        with torch.no_grad():
            want = oracle(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3"])
def test_float_logits_tp2_equal_tp1(tmp_path, name) -> None:
    model = make_family_model(name, str(tmp_path))
    _, ref = _logits(model)
    got = tp_prefill_logits(model, PROMPTS, 2, str(tmp_path))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0)


def test_phi3_fused_checkpoint_is_refused_by_quantize_and_under_tp(tmp_path) -> None:
    src = make_family_model("phi3", str(tmp_path))
    with pytest.raises(ValueError, match="layer 0 has no self_attn.q_proj .*Phi-3"):
        quantize_model(src, os.path.join(tmp_path, "q"), QuantizeOptions(method="rtn", bits=4,
                                                                         group_size=32),
                       progress=False)
    assert not os.path.exists(os.path.join(tmp_path, "q", "model.safetensors"))
    from nybble.distributed.comm import TPGroup
    from nybble.errors import UnsupportedModelError
    from nybble.kernels.reference.attention import TorchAttentionBackend
    from nybble.models.hf_config import load_hf_config
    from nybble.models.linear import dense_linear_factory
    from nybble.models.llama import LlamaForCausalLM
    from nybble.models.registry import arch_spec
    from nybble.models.shape import ModelShape
    from nybble.models.tp_layout import TPLayout

    config = load_hf_config(src)
    layout = TPLayout.of(ModelShape.from_hf_config(config), config.intermediate_size,
                         TPGroup(rank=0, world_size=2))
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size must be 1 .*Phi-3"):
        LlamaForCausalLM(config, dense_linear_factory, TorchAttentionBackend(),
                         64, torch.float32, CPU, arch_spec(config), layout)
