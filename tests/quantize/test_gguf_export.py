"""``nybble quantize --format gguf``: nybble's own integer codes written as GGUF blocks.

Checked against independent readers: gguf-py's ``GGUFReader`` and ``gguf.quants.dequantize``
decode every block to nybble's dequantized weight (Q4_0 / Q8_0 bit-exact, Q4_1 within the fp16
rounding of its minimum ``m``); a dense export equals llama.cpp's own converter output (the
stories3m F32 fixture) tensor for tensor, q/k row permutation included, and its tokenizer
metadata key for key; nybble serves the file with the same logits and greedy tokens as the GPTQ
folder of the same run, and transformers' GGUF loader agrees. Refusals name what is allowed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nybble.cli import main
from nybble.config import DEFAULT_MODEL, ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.gguf_loader import _row_order
from nybble.models.loader import load_model
from nybble.models.scoring import prefill_logits
from nybble.quant.report import summarize_report
from nybble.quantize.driver import QuantizeOptions, quantize_model
from nybble.quantize.gguf_export import encode_blocks, rope_row_order, write_gguf
from nybble.quantize.gguf_vocab import add_tokenizer, bpe_pre_tokenizer, vocab_tokens
from nybble.quantize.gptq import GPTQResult, gptq_quantize
from nybble.quantize.hf_model import load_checkpoint_tensors, read_hf_config
from nybble.quantize.rtn import rtn_quantize
from tests.conftest import shared_path

STORIES3M = shared_path("models", "stories3m")
FIXTURES = shared_path("fixtures", "gguf")
PROMPT = [1, 403, 407, 261, 378]   # BOS "Once upon a time"
HEADS, KV_HEADS = 8, 4              # stories3m


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NYBBLE_CACHE_DIR", str(tmp_path / "cache"))


def _fields(path: str) -> dict[str, object]:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


def _nybble_logits(path: str) -> torch.Tensor:
    loaded = load_model(ModelConfig(model=path, dtype="float32", device="cpu",
                                    cpu_activation_dtype="float32"),
                        TorchAttentionBackend(), torch.device("cpu"))
    return prefill_logits(loaded, [PROMPT])[0]


def _greedy(path: str, n: int = 16) -> list[int]:
    from nybble import LLM
    from nybble.sampling_params import SamplingParams

    llm = LLM(path, dtype="float32", device="cpu", cpu_activation_dtype="float32")
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=n, temperature=0,
                                                            ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


# ---------------------------------------------------------------- blocks (no model needed)

def _random_result(bits: int, sym: bool, n: int = 48, k: int = 96) -> GPTQResult:
    g = torch.Generator().manual_seed(bits * 10 + sym)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = -w[0, :32].abs().max()   # a group at the grid's lower end (q = 0)
    return rtn_quantize(w, bits, 32, sym)


@pytest.mark.parametrize("bits,sym,kind", [(4, True, "Q4_0"), (8, True, "Q8_0")])
def test_exact_blocks_decode_bit_exactly(bits: int, sym: bool, kind: str) -> None:
    res = _random_result(bits, sym)
    got_kind, blocks = encode_blocks(res, bits, sym)
    assert got_kind == kind
    qtype = gguf.GGMLQuantizationType[kind]
    assert blocks.shape == (48, 96 // 32 * gguf.GGML_QUANT_SIZES[qtype][1])
    deq = gguf.quants.dequantize(blocks, qtype)
    assert int(res.q.min()) == 0
    np.testing.assert_array_equal(deq, res.dequant.numpy())


def test_q4_1_differs_only_by_the_fp16_rounding_of_m() -> None:
    res = _random_result(4, False)
    kind, blocks = encode_blocks(res, 4, False)
    assert kind == "Q4_1"
    deq = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    scale, zero = res.scale.numpy().astype(np.float64), res.zero.numpy().astype(np.float64)
    m_exact = -scale * zero
    m16 = m_exact.astype(np.float16).astype(np.float64)
    q = res.q.numpy().astype(np.float64).reshape(48, 3, 32)
    # exactly d*q + fp16(m), then float32
    want = (scale[..., None] * q + m16[..., None]).astype(np.float32).reshape(48, 96)
    np.testing.assert_array_equal(deq, want)
    # against nybble's scale*(q - zero): every weight of a block moves by that block's rounding
    bound = np.repeat(np.abs(m16 - m_exact), 32, axis=1) + 1e-7
    diff = np.abs(deq.astype(np.float64) - res.dequant.numpy())
    assert np.all(diff <= bound) and diff.max() > 0


def test_rope_row_order_is_what_the_loader_undoes() -> None:
    for rows, heads in ((256, 8), (128, 4), (64, 8)):
        order = rope_row_order(rows, heads)
        back = _row_order("blk.0.attn_q.weight", rows, "llama", heads, heads).numpy()
        np.testing.assert_array_equal(order[back], np.arange(rows))


@pytest.mark.parametrize("case,match", [
    ("g64", "group size 32"),
    ("act-order", "g_idx is not k // 32"),
    ("8-bit asym", "8-bit asymmetric"),
])
def test_results_that_cannot_map_are_refused(case: str, match: str) -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    if case == "g64":
        res, bits, sym = rtn_quantize(w, 4, 64, True), 4, True
    elif case == "act-order":
        x = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)) * torch.linspace(
            0.1, 3, 128)
        res, bits, sym = gptq_quantize(w, x.t() @ x, 4, 32, True, desc_act=True), 4, True
    else:
        res, bits, sym = rtn_quantize(w, 8, 32, False), 8, False
    with pytest.raises(ValueError, match=match) as e:
        encode_blocks(res, bits, sym)
    assert "Q4_0" in str(e.value)


@pytest.mark.parametrize("kw,match", [
    ({"group_size": 128}, "--group-size must be 32 for --format gguf"),
    ({"desc_act": True}, "act order"),
    ({"bits": 8, "sym": False}, "8-bit asymmetric"),
    ({"method": "awq", "bits": 8}, "8-bit asymmetric"),
])
def test_options_that_cannot_map_are_refused_up_front(kw: dict, match: str) -> None:
    opts = {"method": "gptq", "bits": 4, "group_size": 32, "sym": True, "format": "gguf"}
    with pytest.raises(ValueError, match=match) as e:
        QuantizeOptions(**{**opts, **kw})
    assert "Q4_0" in str(e.value) and "Q8_0" in str(e.value)


def test_options_that_map() -> None:
    assert QuantizeOptions(method="gptq-e2e", group_size=32, format="gguf").desc_act is False
    QuantizeOptions(method="gptq", group_size=32, desc_act=True, static_groups=True,
                    format="gguf")
    QuantizeOptions(method="awq", bits=4, group_size=32, format="gguf")


@pytest.mark.slow
def test_a_config_that_cannot_map_is_refused_before_quantizing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nybble.quantize import driver
    from tests.models.hf_tiny import make_tiny_model

    def never(*a: object, **k: object) -> None:
        raise AssertionError("quantization started")

    monkeypatch.setattr(driver, "_run", never)
    src = make_tiny_model("llama3-rope", str(tmp_path))   # Llama 3 RoPE scaling
    opts = QuantizeOptions(method="rtn", group_size=32, sym=True, format="gguf")
    with pytest.raises(ValueError, match="supports default and linear RoPE, got 'llama3'"):
        quantize_model(src, str(tmp_path / "x.gguf"), opts, progress=False)
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------- against llama.cpp's converter

@pytest.mark.slow
def test_dense_export_equals_llama_cpp_converter(tmp_path: Path) -> None:
    """Nothing quantized: every tensor (F32, q/k rows permuted) and every tokenizer key equal
    what llama.cpp's convert_hf_to_gguf.py wrote for the same folder."""
    path = str(tmp_path / "s.gguf")
    write_gguf(path, load_checkpoint_tensors(STORIES3M), read_hf_config(STORIES3M), STORIES3M,
               {}, 4, True)
    ours, ref = gguf.GGUFReader(path), gguf.GGUFReader(os.path.join(FIXTURES,
                                                                    "stories3m-F32.gguf"))
    theirs = {t.name: t for t in ref.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for t in ours.tensors:
        assert t.tensor_type == theirs[t.name].tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.array(t.data), np.array(theirs[t.name].data), t.name)
    a, b = _fields(path), {k: f.contents() for k, f in ref.fields.items()}
    for key, value in b.items():
        if key.startswith(("tokenizer.", "llama.")):
            assert a[key] == value, key
    assert a["general.file_type"] == 0 and a["general.architecture"] == "llama"


def test_bpe_pre_tokenizer_names() -> None:
    def split(regex: str) -> dict:
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated"},
            {"type": "ByteLevel", "use_regex": False}]}

    llama3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
              "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    assert bpe_pre_tokenizer({"pre_tokenizer": split(llama3)}) == "llama-bpe"
    assert bpe_pre_tokenizer({"pre_tokenizer": split(llama3.replace("{1,3}", ""))}) == "qwen2"
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert bpe_pre_tokenizer({"pre_tokenizer": byte_level}) == "gpt-2"
    assert bpe_pre_tokenizer({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, byte_level]}}) == "smollm"
    assert bpe_pre_tokenizer({"pre_tokenizer": {"type": "Whitespace"}}) == "default"


def test_added_tokens_and_padding(tmp_path: Path) -> None:
    """An added token past the SentencePiece vocabulary keeps its id and text (CONTROL), the
    rows up to the embedding's size are [PADi] (UNUSED), special tokens are CONTROL."""
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (tmp_path / f).write_bytes(Path(STORIES3M, f).read_bytes())
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": 512, "content": "<|im_end|>", "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    _, tokens, scores, types = vocab_tokens(str(tmp_path), 516)
    assert tokens[511:] == [tokens[511], b"<|im_end|>", b"[PAD513]", b"[PAD514]", b"[PAD515]"]
    control, unused = int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED)
    assert types[512:] == [control, unused, unused, unused] and types[:3] == [control] * 3
    assert scores[:3] == [-1000.0] * 3 and scores[300] < 0   # SentencePiece scores kept
    with pytest.raises(ValueError, match="513 tokens, more than the model's vocab_size 512"):
        vocab_tokens(str(tmp_path), 512)


@pytest.mark.slow
def test_byte_level_bpe_tokenizer_like_llama_cpp(tmp_path: Path) -> None:
    """A GPT-2-style tokenizer (SmolLM2's, 49,152 tokens, rebuilt as a Hugging Face folder by
    transformers from the real GGUF file): tokens, types, merges, special ids and the chat
    template equal that file's, written by llama.cpp's converter. transformers' rebuild keeps
    only a plain ByteLevel pre-tokenizer; SmolLM2's own tokenizer.json splits digits first,
    which is restored here to check the name llama.cpp gives it."""
    from transformers import AutoTokenizer

    folder = shared_path("models", "smollm2-135m-instruct")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp_path)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, tj["pre_tokenizer"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    path = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(path, "llama")
    assert add_tokenizer(w, str(tmp_path), 49152) == "gpt2"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = _fields(path), _fields(os.path.join(folder, name))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"):
        assert ours[key] == ref[key], key


# ---------------------------------------------------------------- a real GPTQ run, both outputs

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str, dict]]:
    """stories3m, GPTQ 4-bit g32 symmetric and asymmetric: the folder and the GGUF file."""
    root = tmp_path_factory.mktemp("gguf_runs")
    out = {}
    for kind, sym in (("Q4_0", True), ("Q4_1", False)):
        common = {"method": "gptq", "bits": 4, "group_size": 32, "sym": sym, "num_samples": 8,
                  "seq_len": 128}
        folder, path = str(root / kind), str(root / f"stories3m-{kind}.gguf")
        summary = quantize_model(STORIES3M, folder, QuantizeOptions(**common), progress=False)
        g = quantize_model(STORIES3M, path, QuantizeOptions(**common, format="gguf"),
                           progress=False)
        for name, res in summary["results"].items():   # deterministic: the same codes
            assert torch.equal(res.q, g["results"][name].q)
        out[kind] = (folder, path, summary)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_py_reads_back_the_codes(runs: dict, kind: str) -> None:
    _, path, summary = runs[kind]
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 38 and "output.weight" not in tensors   # tied
    seen = 0
    for prefix, res in summary["results"].items():
        layer, module = prefix.split(".")[2], prefix.split(".")[-1]
        gname = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                 "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                 "down_proj": "ffn_down"}[module]
        t = tensors[f"blk.{layer}.{gname}.weight"]
        assert t.tensor_type.name == kind
        deq = gguf.quants.dequantize(t.data, t.tensor_type)
        want = res.dequant.numpy()
        if gname in ("attn_q", "attn_k"):   # llama.cpp's row order
            want = want[rope_row_order(want.shape[0], HEADS if gname == "attn_q" else KV_HEADS)]
        if kind == "Q4_0":
            np.testing.assert_array_equal(deq, want, prefix)
        else:   # Q4_1: m = -scale*zero rounded to fp16, at most half an fp16 ulp of |m|
            bound = np.abs(want).max() * 2.0 ** -11 + 1e-7
            assert np.abs(deq - want).max() <= bound, prefix
        seen += 1
    assert seen == 28
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight"):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
    meta = _fields(path)
    with open(os.path.join(STORIES3M, "tokenizer_config.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    assert meta["tokenizer.chat_template"] == template
    assert meta["tokenizer.ggml.model"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 512
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["general.file_type"] == {"Q4_0": 2, "Q4_1": 3}[kind]
    assert meta["llama.context_length"] == 512 and meta["llama.attention.head_count_kv"] == 4
    report = json.loads(Path(path[:-5] + ".quantization_report.json").read_text())
    assert report["quantization_config"]["type"] == kind
    assert summarize_report(path).startswith("quantized by nybble")


@pytest.mark.slow
def test_served_like_the_gptq_folder_q4_0(runs: dict) -> None:
    folder, path, _ = runs["Q4_0"]
    torch.testing.assert_close(_nybble_logits(path), _nybble_logits(folder), atol=1e-5,
                               rtol=1e-6)
    assert _greedy(path) == _greedy(folder)


@pytest.mark.slow
def test_served_like_the_gptq_folder_q4_1(runs: dict) -> None:
    """Q4_1's m rounding moves the weights by at most 3e-5 here, the logits by 4e-3."""
    folder, path, _ = runs["Q4_1"]
    torch.testing.assert_close(_nybble_logits(path), _nybble_logits(folder), atol=1e-2,
                               rtol=0)
    assert _greedy(path) == _greedy(folder)


@pytest.mark.slow
def test_transformers_reads_it_like_the_folder(runs: dict) -> None:
    """An independent reader: transformers' GGUF loader (gguf-py dequantization, its own
    undoing of the q/k permutation) against nybble on the GPTQ folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, path, _ = runs["Q4_0"]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, _nybble_logits(folder), atol=1e-4, rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert tok("Once upon a time")["input_ids"] == PROMPT


# ---------------------------------------------------------------- tiny models: qwen2, untied head

@pytest.mark.slow
@pytest.mark.parametrize("variant,method,lm_head", [("qwen2", "rtn", False),
                                                    ("llama-gqa", "rtn", True),
                                                    ("llama-gqa", "awq", False)])
def test_tiny_families(tmp_path: Path, variant: str, method: str, lm_head: bool) -> None:
    """qwen2 (q/k/v biases, no row permutation), an untied Llama whose head is quantized
    (``output`` Q8_0), and AWQ 4-bit (AutoAWQ's layout in the folder, Q4_1 in the file):
    served like the folder."""
    from tests.models.hf_tiny import make_tiny_model

    src = make_tiny_model(variant, str(tmp_path))
    common = {"method": method, "bits": 4, "group_size": 32, "sym": True, "num_samples": 2,
              "seq_len": 32, "lm_head": lm_head}
    folder, path = str(tmp_path / "q"), str(tmp_path / "q.gguf")
    quantize_model(src, folder, QuantizeOptions(**common), progress=False)
    quantize_model(src, path, QuantizeOptions(**common, format="gguf"), progress=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    kind = "Q4_1" if method == "awq" else "Q4_0"
    assert types["blk.1.ffn_down.weight"] == types["blk.0.attn_k.weight"] == kind
    if lm_head:
        assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "F32"
    elif variant == "qwen2":
        assert types["blk.0.attn_q.bias"] == "F32" and "output.weight" not in types
    assert _fields(path)["general.architecture"] == ("qwen2" if variant == "qwen2" else "llama")
    torch.testing.assert_close(_nybble_logits(path), _nybble_logits(folder),
                               atol=1e-3 if kind == "Q4_1" else 1e-5, rtol=1e-6)


# ---------------------------------------------------------------- the CLI, bundled model

@pytest.mark.slow
def test_cli_rtn_8bit_to_q8_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """stories260k: its MLP (172 wide) cannot form blocks of 32 -> down_proj stays F32
    (--allow-unquantized); everything else Q8_0, served like the folder."""
    path, folder = str(tmp_path / "out" / "s260k-Q8_0.gguf"), str(tmp_path / "q")
    args = ["quantize", DEFAULT_MODEL, "--method", "rtn", "--bits", "8", "--group-size", "32",
            "--sym", "--num-samples", "2", "--seq-len", "32", "--allow-unquantized"]
    assert main(args + ["--format", "gguf", "--out", path]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["quantization_config"]["type"] == "Q8_0"
    assert printed["report"] == "s260k-Q8_0.quantization_report.json"
    assert printed["summary"].startswith("quantized by nybble")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == "F32" and types["blk.0.ffn_up.weight"] == "Q8_0"
    assert types["blk.4.attn_q.weight"] == "Q8_0"
    assert main(args + ["--out", folder]) == 0
    torch.testing.assert_close(_nybble_logits(path), _nybble_logits(folder), atol=1e-5,
                               rtol=1e-6)
    assert _greedy(path) == _greedy(folder)


@pytest.mark.parametrize("extra,match", [
    (["--group-size", "128", "--format", "gguf", "--out", "x.gguf"],
     "--group-size must be 32 for --format gguf"),
    (["--group-size", "32", "--desc-act", "--format", "gguf", "--out", "x.gguf"], "act order"),
    (["--group-size", "32", "--format", "gguf", "--out", "folder"],
     "--out must be the .gguf file"),
    (["--group-size", "32", "--out", "x.gguf"], "add --format gguf"),
])
def test_cli_refusals_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch, extra: list[str],
                                      match: str) -> None:
    from nybble.quantize import driver

    def never(*a: object, **k: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(driver, "_run", never)
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", DEFAULT_MODEL, "--method", "gptq"] + extra) == 2
    assert match in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["cache"] or os.listdir(tmp_path) == []
