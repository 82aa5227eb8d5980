"""nybble's own RTN / GPTQ 4-bit of tiny Qwen3-MoE and Mixtral checkpoints: every expert
projection is written in the dense layers' packed GPTQ format under the checkpoint's names,
and the engine's model serves the folder with logits within the dense models' bound (2e-3 on
the exact CPU path, tests/quant/test_fixture_engine_logits.py) of the oracle (transformers
carrying our quantized modules, nybble.quantize.hf_model), greedy tokens equal; methods and
formats MoE does not take are refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.moe import MoEBlock
from nybble.models.scoring import prefill_logits
from nybble.quant.linear import QuantLinear
from nybble.quantize import hf_model
from nybble.quantize.driver import QuantizeOptions, quantize_model
from tests.models.hf_moe import make_moe_model

PROMPTS = [[1, 403, 407, 261, 378, 300, 301], list(range(3, 30)), [7]]
CALIB = "\n\n".join(f"Story {i}: the little dog ran to the park and saw {i} red birds "
                    f"singing in the tall green tree by the river." for i in range(60))


@pytest.mark.parametrize("name,method", [("qwen3-moe", "rtn"), ("qwen3-moe", "gptq"),
                                         ("mixtral", "gptq")])
def test_quantized_moe_is_served_within_the_dense_bound(tmp_path, name, method) -> None:
    src = make_moe_model(name, str(tmp_path))
    out = os.path.join(tmp_path, f"{name}-{method}")
    opts = QuantizeOptions(method=method, bits=4, group_size=32, calib_text=CALIB,
                           num_samples=16, seq_len=64)
    done = quantize_model(src, out, opts, progress=False)
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    down = "w2" if name == "mixtral" else "down_proj"
    expert = f"model.layers.0.{block}.experts.3.{down}"
    assert expert in done["quantized"] and not done["skipped"]
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {f"{expert}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")} <= keys
    assert f"{expert}.weight" not in keys and f"model.layers.0.{block}.gate.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)   # no stacked float experts written

    loaded = load_model(ModelConfig(model=out, dtype="float32", device="cpu",
                                    cpu_activation_dtype="float32"),
                        TorchAttentionBackend(), torch.device("cpu"))
    moe = loaded.model.layers[0].mlp
    assert isinstance(moe, MoEBlock) and moe.w13 is None
    assert all(isinstance(m, QuantLinear) for m in [*moe.gate_up, *moe.down])
    # experts sized on the host each step: the engine keeps CUDA graphs off for this model
    assert "quantized mixture-of-experts" in loaded.model.cuda_graph_blocker()
    oracle = hf_model.load_model(out)
    for ours, ids in zip(prefill_logits(loaded, PROMPTS), PROMPTS):
        with torch.no_grad():
            want = oracle(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, want, atol=2e-3, rtol=0)


def test_engine_greedy_equals_the_oracle(tmp_path) -> None:
    from nybble import LLM, SamplingParams

    src = make_moe_model("qwen3-moe", str(tmp_path))
    out = os.path.join(tmp_path, "q")
    quantize_model(src, out, QuantizeOptions(method="rtn", bits=4, group_size=32),
                   progress=False)
    ids = [1, 403, 407, 261]
    got = LLM(model=out, max_num_seqs=2).generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True), use_tqdm=False)
    oracle = hf_model.load_model(out)
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            x = torch.cat([x, oracle(input_ids=x).logits[0, -1].argmax().view(1, 1)], dim=1)
    assert list(got[0].outputs[0].token_ids) == x[0, len(ids):].tolist()
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "gptq"


@pytest.mark.parametrize("change,message", [
    ({"method": "awq"}, "method rtn or gptq, got 'awq'"),
    ({"method": "gptq-e2e"}, "method rtn or gptq, got 'gptq-e2e'"),
    ({"method": "rtn", "format": "gguf", "group_size": 32},
     "written as a model folder \\(format hf\\), got format 'gguf'"),
])
def test_methods_moe_does_not_take_are_refused(tmp_path, change, message) -> None:
    src = make_moe_model("mixtral", str(tmp_path))
    opts = QuantizeOptions(**{"bits": 4, "group_size": 32, **change})
    with pytest.raises(ValueError, match=message):
        quantize_model(src, os.path.join(tmp_path, "out"), opts, progress=False)
    assert not os.path.exists(os.path.join(tmp_path, "out", "model.safetensors"))
