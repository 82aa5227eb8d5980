"""``nybble quantize --quantize-lm-head``: the output head written as a GPTQ INT8 module
(GPTQModel's ``lm_head: true`` with a ``dynamic`` override for its settings), the tied
embedding kept float and the config untied; the engine's loader runs it quantized
(``quant_head``), and its logits equal the float64 product with the head's published
dequantization and transformers' forward over the same folder (nybble's quantized modules in a
transformers model, ``nybble.quantize.hf_model``)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nybble.config import DEFAULT_MODEL, ModelConfig
from nybble.errors import UnsupportedModelError
from nybble.kernels.cpu import qgemm_pack
from nybble.kernels.cpu.weight_only import error_bound
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.quant.linear import GPTQLinear
from nybble.quantize import hf_model
from nybble.quantize.driver import QuantizeOptions, quantize_model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("qhead") / "out")
    opts = QuantizeOptions(method="rtn", bits=4, group_size=32, sym=False, lm_head=True,
                           allow_unquantized=True)
    return out, quantize_model(DEFAULT_MODEL, out, opts, progress=False)


def _engine_model(path: str, activations: str = "auto"):  # type: ignore[no-untyped-def]
    return load_model(ModelConfig(model=path, dtype="float32", device="cpu",
                                  cpu_activation_dtype=activations),
                      TorchAttentionBackend(), torch.device("cpu"))


def test_folder_holds_an_int8_head_and_an_untied_config(quantized) -> None:
    out, _ = quantized
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["tie_word_embeddings"] is False
    q = cfg["quantization_config"]
    assert q["lm_head"] is True and q["bits"] == 4
    assert q["dynamic"] == {"+:lm_head$": {"bits": 8, "sym": True}}
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in tensors
    assert tensors["lm_head.qweight"].shape == (64 // 4, 512)     # 8 bits: 4 per int32 word
    assert tensors["lm_head.scales"].shape == (2, 512)             # K = 64 in groups of 32
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32


def test_engine_runs_the_head_quantized(quantized) -> None:
    out, summary = quantized
    loaded = _engine_model(out)
    model = loaded.model
    head = model.quant_head
    assert isinstance(head, GPTQLinear) and head.bits == 8 and model.lm_head is None
    # the published dequantization (fp16 scales times (q - z), rounded to fp16) in float64,
    # within the documented bound of the CPU kernel that runs it (it keeps s (q - z)
    # unrounded): the float32 weight-only one, with AVX-512 BF16 the bf16-dot one, whose
    # bound is against the bf16-rounded activations, with VNNI the integer-dot one, whose
    # bound is against the block-quantized activations
    w = head.dequantized_weight().double()
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    if head.cpu_packed is not None:
        # its bound is against the exact s (q - z) (no fp16 rounding of the products)
        iw, scales = head.int_weight(), head.weight_scales().double()
        rows = torch.arange(iw.q.shape[0]) // iw.group_size
        exact = (iw.q.double() - iw.zero.double()[rows]) * scales[rows]        # [K, N]
        planes = head.cpu_packed.planes
        if planes:
            want = qgemm_pack.quantize_activations(h, iw.group_size, planes) @ exact
            bound = qgemm_pack.idot_error_bound(h, iw, head.weight_scales(), None, planes)
        else:
            want = qgemm_pack.round_bf16(h).double() @ exact
            bound = qgemm_pack.error_bound(h, iw, head.weight_scales())
    else:
        want = h.double() @ w.t()
        bound = error_bound(h, head.int_weight(), head.weight_scales())
    err = (model.compute_logits(h).double() - want).abs()
    assert bool((err <= bound).all()) and float(err.max()) > 0
    ids = [1, 400, 261, 300, 280, 290, 310, 330]
    hf = hf_model.load_model(out)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    exact = _engine_model(out, "float32")   # the exact path: transformers' float32 sums
    torch.testing.assert_close(prefill_logits(exact, [ids])[0], expected, atol=1e-4,
                               rtol=1e-5)
    assert summary["report"]["bytes"]["linear_after"] > 0


def test_config_without_head_tensors_is_refused(quantized, tmp_path) -> None:
    out, _ = quantized
    bad = str(tmp_path / "bad")
    os.makedirs(bad)
    for f in os.listdir(out):
        if f != "model.safetensors":
            with open(os.path.join(out, f), "rb") as src, open(os.path.join(bad, f), "wb") as dst:
                dst.write(src.read())
    tensors = {k: v for k, v in load_file(os.path.join(out, "model.safetensors")).items()
               if not k.startswith("lm_head.")}
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="lm_head"):  # named, whichever check fires
        _engine_model(bad)


def test_awq_head_is_refused() -> None:
    with pytest.raises(ValueError, match="GPTQ-format head"):
        QuantizeOptions(method="awq", lm_head=True)
