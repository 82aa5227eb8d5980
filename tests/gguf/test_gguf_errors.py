"""Bad GGUF files give one clear line at start-up: truncated, bad magic, an unsupported
tensor type (named with the tensor and the supported list), an unsupported architecture, a
mixture-of-experts file without stacked experts, a split model without its shards; and a
quantization flag that does not fit."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nybble.cli import main
from nybble.config import ModelConfig
from nybble.errors import UnsupportedModelError
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from tests.conftest import shared_path

Q40 = os.path.join(shared_path("fixtures", "gguf"), "stories3m-Q4_0.gguf")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NYBBLE_CACHE_DIR", str(tmp_path / "cache"))


def _load(path: str, **kw: object) -> None:
    load_model(ModelConfig(model=path, device="cpu", **kw), TorchAttentionBackend(),
               torch.device("cpu"))


def _rewrite(src: str, dst: str, arch: str | None = None,
             retype: tuple[str, gguf.GGMLQuantizationType] | None = None) -> None:
    """Copy ``src`` with gguf-py's writer, optionally renaming the architecture or storing
    one tensor as another type (random bytes of that type's size)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        key = key.replace("llama.", f"{arch}.") if arch else key
        w.add_key_value(key, f.contents(), vtype, sub)
    for t in r.tensors:
        data, rtype = np.array(t.data), t.tensor_type
        if retype is not None and t.name == retype[0]:
            rtype = retype[1]
            block, size = gguf.GGML_QUANT_SIZES[rtype]
            rows, k = int(t.shape[1]), int(t.shape[0])
            data = np.random.default_rng(0).integers(0, 255, (rows, k // block * size),
                                                     dtype=np.uint8)
        w.add_tensor(t.name, data, raw_dtype=rtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_truncated_file(tmp_path: Path) -> None:
    p = tmp_path / "cut.gguf"
    p.write_bytes(Path(Q40).read_bytes()[:1_000_000])
    with pytest.raises(UnsupportedModelError, match="truncated"):
        _load(str(p))


def test_bad_magic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + Path(Q40).read_bytes()[4:])
    with pytest.raises(UnsupportedModelError, match="must start with the magic b'GGUF'"):
        _load(str(p))
    assert main(["generate", "--model", str(p), "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a GGUF file" in err[0]


def test_unsupported_type_names_tensor_and_supported(tmp_path: Path) -> None:
    p = tmp_path / "q2k.gguf"
    _rewrite(Q40, str(p), retype=("blk.1.ffn_up.weight", gguf.GGMLQuantizationType.Q2_K))
    with pytest.raises(UnsupportedModelError,
                       match=r"blk\.1\.ffn_up\.weight has type Q2_K.*supported: Q4_0, Q4_1"):
        _load(str(p))


def test_unsupported_architecture(tmp_path: Path) -> None:
    p = tmp_path / "arch.gguf"
    _rewrite(Q40, str(p), arch="gpt2")
    with pytest.raises(UnsupportedModelError,
                       match="general.architecture must be one of llama, qwen2, qwen3, "
                             "qwen3moe, gemma2, gemma3, phi3, got 'gpt2'"):
        _load(str(p))


def _with_keys(dst: Path, **keys: int) -> None:
    """stories3m Q4_0 with extra ``llama.*`` uint32 keys."""
    r = gguf.GGUFReader(Q40)
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype,
                        f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for key, value in keys.items():
        w.add_uint32(f"llama.{key}", value)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_mixture_of_experts_file_without_stacked_experts_is_refused(tmp_path: Path) -> None:
    """A Mixtral-style file (``llama.expert_count`` set) is read as Mixtral, not misread as a
    dense Llama: without ``expert_used_count``, or without llama.cpp's stacked expert tensors
    (older files held one tensor per expert), it is refused naming what is missing."""
    p = tmp_path / "moe.gguf"
    _with_keys(p, expert_count=8)
    with pytest.raises(UnsupportedModelError, match=r"expert_used_count must be in \[1, "
                       r"expert_count = 8\], got 0"):
        _load(str(p))
    q = tmp_path / "moe2.gguf"
    _with_keys(q, expert_count=8, expert_used_count=2)
    with pytest.raises(UnsupportedModelError, match=r"lacks tensor 'blk\.0\.ffn_gate_exps\."
                       r"weight' \(experts must be stacked per projection"):
        _load(str(q))


def test_split_without_shards(tmp_path: Path) -> None:
    p = tmp_path / "story-00001-of-00002.gguf"
    shutil.copy(Q40, p)
    with pytest.raises(UnsupportedModelError,
                       match=r"needs all 2 of its shards.*missing \['story-00002-of-00002.gguf'\]"):
        _load(str(p))


def test_quantization_flag(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="must be unset or 'gguf' for a GGUF file"):
        _load(Q40, quantization="gptq")
    with pytest.raises(UnsupportedModelError, match="'gguf' needs a .gguf model file"):
        _load(shared_path("fixtures", "quant", "tiny-llama-fp32"), quantization="gguf")


def test_a_folder_holding_only_a_gguf_file_names_the_file(tmp_path: Path) -> None:
    """The folder of a published GGUF (no config.json) is refused with the file to pass."""
    from nybble.model_files import check_model_dir

    folder = tmp_path / "published"
    folder.mkdir()
    os.symlink(Q40, folder / "model-Q4_0.gguf")
    with pytest.raises(UnsupportedModelError, match=r"has no config\.json but holds GGUF file"
                       r"\(s\) \(model-Q4_0\.gguf\): pass the file itself"):
        check_model_dir(str(folder))
