"""Acceptance tests of the loader against the tools' own outputs (shared/fixtures/quant).

For every checkpoint: our dequantized weights equal the tool's ``dequant.*`` bit for bit
(fp16), repacking the unpacked integers gives identical words, and a transformers Llama with
our quantized modules reproduces the tool's logits (atol 2e-3; W8A8 see below).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from nybble.errors import UnsupportedModelError
from nybble.kernels.packing import AWQ_ORDER, pack_cols, pack_rows, unpack_cols, unpack_rows
from nybble.models.linear import build_linear
from nybble.quant.config import load_quant_config
from nybble.quant.linear import GPTQLinear, weight_bytes
from nybble.quantize.hf_model import load_checkpoint_tensors, load_model
from tests.conftest import shared_path

BASE = shared_path("fixtures", "quant")
DIRS = sorted(d for d in os.listdir(BASE) if d.startswith("tiny-llama-") and d != "tiny-llama-fp32")


def _ref(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(BASE, d, "reference_outputs.safetensors"))


@pytest.fixture(scope="module", params=DIRS)
def loaded(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, dict[str, torch.Tensor]]:
    d = request.param
    return d, load_model(os.path.join(BASE, d)), _ref(d)


def test_dequant_bit_exact(loaded: tuple[str, torch.nn.Module, dict[str, torch.Tensor]]) -> None:
    d, model, ref = loaded
    n = 0
    for name, mod in model.named_modules():
        if hasattr(mod, "dequantized_weight"):
            ours = mod.dequantized_weight().to(torch.float16)
            assert torch.equal(ours, ref[f"dequant.{name}.weight"]), name
            n += 1
    assert n == 14  # 2 layers x 7 linears, all quantized


def test_logits_match_tool(loaded: tuple[str, torch.nn.Module, dict[str, torch.Tensor]]) -> None:
    d, model, ref = loaded
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.float()
    if d == "tiny-llama-ct-w8a8":
        # the tool fake-quantizes activations in fp16 (a different rounding path); our int8
        # path lands at 1.1e-2 from its logits, where its own weight-only logits are 8.3e-3 away
        assert (logits - ref["logits"]).abs().max() < 1.5e-2
        assert (logits - ref["logits_weight_only"]).abs().max() > 1e-3  # activations quantized
    else:
        torch.testing.assert_close(logits, ref["logits"], atol=2e-3, rtol=0)


@pytest.mark.parametrize("d", DIRS)
def test_repack_identical_words(d: str) -> None:
    cfg = json.load(open(os.path.join(BASE, d, "config.json")))["quantization_config"]
    t = load_checkpoint_tensors(os.path.join(BASE, d))
    checked = 0
    for k, v in t.items():
        if k.endswith(".qweight"):
            p = k[:-len(".qweight")]
            if cfg["quant_method"] == "gptq":
                b = cfg["bits"]
                assert torch.equal(pack_rows(unpack_rows(v, b), b), v)
                assert torch.equal(pack_cols(unpack_cols(t[p + ".qzeros"], b), b), t[p + ".qzeros"])
            else:
                assert torch.equal(pack_cols(unpack_cols(v, 4, AWQ_ORDER), 4, AWQ_ORDER), v)
            checked += 1
        elif k.endswith(".weight_packed"):
            assert torch.equal(pack_cols(unpack_cols(v, 4), 4), v)
            checked += 1
    assert checked == 14 or d == "tiny-llama-ct-w8a8"


def test_v1_v2_cross_tool_zero_words() -> None:
    v1 = load_checkpoint_tensors(os.path.join(BASE, "tiny-llama-gptq-4bit-g32-asym"))
    v2 = load_checkpoint_tensors(os.path.join(BASE, "tiny-llama-gptqmodel-4bit-g32-asym-v2"))
    k = "model.layers.0.self_attn.q_proj.qzeros"
    z1 = (unpack_cols(v1[k], 4) + 1) & 15
    assert torch.equal(z1, unpack_cols(v2[k], 4))


def test_fused_qkv_equals_separate() -> None:
    d = os.path.join(BASE, "tiny-llama-gptq-4bit-g32-actorder")
    cfg = json.load(open(os.path.join(d, "config.json")))
    qc = load_quant_config(d, cfg, "gptq")
    assert qc is not None
    t = load_checkpoint_tensors(d)
    pre = [f"model.layers.1.self_attn.{x}_proj" for x in "qkv"]
    mod = qc.linear_factory(pre, 128, [128, 64, 64], False, torch.float32, torch.device("cpu"))
    assert isinstance(mod, GPTQLinear)
    fused = {}
    for name, dim in mod.output_dims.items():
        parts = [t[f"{p}.{name}"] for p in pre if f"{p}.{name}" in t]
        fused[name] = parts[0] if dim is None else torch.cat(parts, dim)
    mod.load_tensors(fused)
    assert mod.act_order and mod.bias is None  # AutoGPTQ's zero biases are dropped
    x = torch.randn(5, 128)
    ref = _ref("tiny-llama-gptq-4bit-g32-actorder")
    w = torch.cat([ref[f"dequant.{p}.weight"] for p in pre]).double()
    torch.testing.assert_close(mod(x.double()), x.double() @ w.t(), atol=1e-12, rtol=0)
    # packed bytes: int4 g32 vs fp16 weights of the same projection
    assert weight_bytes(mod) / (256 * 128 * 2) < 0.32


def _cfg(d: str) -> dict:
    return json.load(open(os.path.join(BASE, d, "config.json")))


def test_override_mismatch_and_unsupported(tmp_path: str) -> None:
    d = os.path.join(BASE, "tiny-llama-awq-4bit-g32")
    with pytest.raises(UnsupportedModelError, match="'gptq' was requested.*'awq'"):
        load_quant_config(d, _cfg("tiny-llama-awq-4bit-g32"), "gptq")
    with pytest.raises(UnsupportedModelError, match="no quantization_config"):
        load_quant_config(os.path.join(BASE, "tiny-llama-fp32"), _cfg("tiny-llama-fp32"), "awq")
    assert load_quant_config(os.path.join(BASE, "tiny-llama-fp32"), _cfg("tiny-llama-fp32")) is None
    bad = [({"quant_method": "gptq", "bits": 3}, "gptq bits"),
           ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "marlin"),
           ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "gemv_fast"),
           ({"quant_method": "awq", "bits": 8}, "awq bits"),
           ({"quant_method": "bitsandbytes"}, "bitsandbytes")]
    for qcfg, what in bad:
        with pytest.raises(UnsupportedModelError, match=what) as e:
            load_quant_config(str(tmp_path), {"quantization_config": qcfg})
        assert "supported:" in str(e.value)


def test_quantize_config_json_and_synonyms(tmp_path: str) -> None:
    with open(os.path.join(tmp_path, "quant_config.json"), "w") as f:
        json.dump({"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}, f)
    qc = load_quant_config(str(tmp_path), {})
    assert qc is not None and qc.method == "awq" and qc.params.group_size == 64
    d = "tiny-llama-gptq-4bit-g32"
    qc = load_quant_config(os.path.join(BASE, d), {k: v for k, v in _cfg(d).items()
                                                  if k != "quantization_config"})
    assert qc is not None and qc.fmt == "gptq" and qc.params.bits == 4
    assert "gptq" in qc.describe()


def test_dynamic_skip_rule(tmp_path: str) -> None:
    qc = load_quant_config(str(tmp_path), {"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
        "dynamic": {r"-:.*\.mlp\..*": {}, r"+:.*\.q_proj": {"bits": 8}}}})
    assert qc is not None
    assert qc.layer_params("model.layers.0.mlp.up_proj") is None
    assert qc.layer_params("model.layers.0.self_attn.q_proj").bits == 8
    assert qc.layer_params("model.layers.0.self_attn.k_proj").bits == 4
    assert qc.layer_params("lm_head") is None
    args = (["model.layers.0.mlp.up_proj"], 128, [256], False, torch.float32,
            torch.device("cpu"))
    assert qc.linear_factory(*args) is None  # "stay dense": the models build the layer
    dense = build_linear(qc.linear_factory, *args)
    assert type(dense).__name__ == "DenseLinear"


def test_per_channel_group_size_resolved_by_the_config() -> None:
    d = "tiny-llama-gptq-4bit-perchannel"
    qc = load_quant_config(os.path.join(BASE, d), _cfg(d))
    assert qc is not None and qc.params.group_size == -1  # as the checkpoint says
    mod = qc.linear_factory(["model.layers.0.mlp.down_proj"], 256, [128], False,
                            torch.float32, torch.device("cpu"))
    assert isinstance(mod, GPTQLinear)
    assert (mod.group_size, mod.num_groups, tuple(mod.scales.shape)) == (256, 1, (1, 128))
    with pytest.raises(ValueError, match="group_size must be a positive"):
        GPTQLinear(256, 128, False, torch.float32, torch.device("cpu"), 4, -1, 1, True)
