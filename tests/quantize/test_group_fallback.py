"""A group size that does not divide a Linear's input width (SmolLM2's 576 at the default 128):
that Linear is quantized at the largest multiple of 8 below it that divides, recorded as a
GPTQModel ``dynamic`` override, and served with those groups; the format spec's grid is the
oracle for the written integers and scales, transformers on the dequantized weights for the
served logits. A Linear that cannot be packed at all makes the run an error unless
``--allow-unquantized``; AutoAWQ's 4-bit format (one group size) refuses the fallback."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from nybble.cli import main
from nybble.config import DEFAULT_MODEL
from nybble.quant.config import load_quant_config
from nybble.quantize.driver import QuantizeOptions, group_overrides, quantize_model
from nybble.quantize.eval_ppl import nybble_logits_fn
from nybble.quantize.layer_quant import group_size_for

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_group_size_for() -> None:
    assert group_size_for(576, 128) == 96 and group_size_for(1536, 128) == 128
    assert group_size_for(96, 64) == 48 and group_size_for(64, 48) == 32
    assert group_size_for(172, 48) is None          # no multiple of 8 divides 172
    assert group_size_for(100, -1) == -1


def test_overrides_per_module_name_or_per_layer() -> None:
    uniform = {f"model.layers.{i}.self_attn.q_proj": 48 for i in range(3)}
    assert group_overrides(uniform) == {
        r"+:model\.layers\.\d+\.self_attn\.q_proj$": {"group_size": 48}}
    mixed = {"model.layers.0.mlp.up_proj": 48, "model.layers.2.mlp.up_proj": 32,
             "model.layers.1.self_attn.q_proj": 48}
    got = group_overrides(mixed)
    assert got == {r"+:model\.layers\.0\.mlp\.up_proj$": {"group_size": 48},
                   r"+:model\.layers\.2\.mlp\.up_proj$": {"group_size": 32},
                   r"+:model\.layers\.1\.self_attn\.q_proj$": {"group_size": 48}}
    for prefix, gs in mixed.items():   # the loader's reading: each module gets its own size
        assert [o["group_size"] for k, o in got.items() if re.match(k[2:], prefix)] == [gs]


@pytest.fixture(scope="module")
def wide96(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose hidden width 96 is not a multiple of 64 (intermediate 256 is)."""
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("wide") / "wide96")
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL, f), path)
    return path


def _spec_rtn_sym(w: torch.Tensor, group: int) -> torch.Tensor:
    """4-bit symmetric RTN by the GPTQ grid (format spec §7.1), float16 scales: the
    dequantized weight [N, K]."""
    n, k = w.shape
    g = w.double().reshape(n, k // group, group)
    xmax = torch.maximum(g.abs().amax(-1), torch.full((n, k // group), 1e-12, dtype=torch.float64))
    scale = (2 * xmax / 15).half().double()
    q = torch.clamp(torch.round(g / scale[..., None]) + 8, 0, 15)
    return ((q - 8) * scale[..., None]).reshape(n, k)


@pytest.fixture(scope="module")
def quantized(wide96: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("q") / "rtn")
    opts = QuantizeOptions(method="rtn", bits=4, group_size=64, sym=True, num_samples=2,
                           seq_len=32)
    return out, quantize_model(wide96, out, opts, progress=False)


def test_every_linear_is_quantized_and_the_groups_recorded(quantized) -> None:
    out, summary = quantized
    assert summary["skipped"] == {} and len(summary["quantized"]) == 14
    assert summary["regrouped"] == {f"model.layers.{i}.{n}": 48 for i in range(2)
                                    for n in LINEARS if n != "mlp.down_proj"}
    cfg = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert cfg["group_size"] == 64 and len(cfg["dynamic"]) == 6
    qc = load_quant_config(out, {"quantization_config": cfg})
    assert qc.layer_params("model.layers.1.self_attn.q_proj").group_size == 48
    assert qc.layer_params("model.layers.1.mlp.down_proj").group_size == 64
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.scales"].shape == (96 // 48, 96)
    assert tensors["model.layers.0.mlp.down_proj.scales"].shape == (256 // 64, 96)


def test_written_weights_follow_the_format_grid(wide96: str, quantized) -> None:
    _, summary = quantized
    fp = LlamaForCausalLM.from_pretrained(wide96, dtype=torch.float32)
    for name, group in (("model.layers.0.self_attn.q_proj", 48),
                        ("model.layers.1.mlp.gate_proj", 48),
                        ("model.layers.1.mlp.down_proj", 64)):
        w = fp.get_submodule(name).weight.detach()
        want = _spec_rtn_sym(w, group)
        got = summary["results"][name].dequant.half().double()
        torch.testing.assert_close(got, want.half().double(), rtol=0, atol=1e-3 * w.abs().max())


def test_served_logits_equal_transformers_on_the_dequantized_weights(wide96: str,
                                                                    quantized) -> None:
    out, summary = quantized
    ref = LlamaForCausalLM.from_pretrained(wide96, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, res in summary["results"].items():
            ref.get_submodule(name).weight.copy_(res.dequant.half().float())
    ids = [1, 400, 261, 300, 280, 290, 310, 330, 350, 270]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = nybble_logits_fn(out, cpu_activation_dtype="float32")(torch.tensor(ids))
    # float32 sums in another order (measured 2.6e-4 at most)
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=0, atol=1e-3)


def test_cli_prints_what_it_did(wide96: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", wide96, "--method", "rtn", "--group-size", "64", "--sym",
                 "--num-samples", "2", "--seq-len", "32", "--out", str(tmp_path / "q")]) == 0
    err = capsys.readouterr().err
    assert ("quantized 14 of 14 decoder linear layers (2 at group size 64, 12 at group size 48 "
            "(64 does not divide their inputs))") in err


def test_awq_4bit_cannot_regroup(wide96: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "awq"
    assert main(["quantize", wide96, "--method", "awq", "--group-size", "64",
                 "--num-samples", "2", "--seq-len", "32", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "12 of 14 linear layers cannot be quantized with these settings" in err
    assert "input width 96 is not a multiple of group_size 64" in err
    assert "or a method written as GPTQ" in err and not out.exists()


def test_unpackable_layers_need_allow_unquantized(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """stories260k's MLP widths (172) are not multiples of 4-bit packing's 8."""
    out = tmp_path / "q"
    args = ["quantize", DEFAULT_MODEL, "--method", "rtn", "--group-size", "32",
            "--num-samples", "2", "--seq-len", "32", "--out", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "15 of 35 linear layers cannot be quantized with these settings" in err
    assert "--allow-unquantized" in err and not out.exists()
    assert main(args + ["--allow-unquantized"]) == 0
    err = capsys.readouterr().err
    assert "quantized 20 of 35 decoder linear layers (20 at group size 32); 15 left dense" in err
