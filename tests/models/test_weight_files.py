"""Which files of a model folder are weights (``model_weight_files``): the index's files, or
``model.safetensors``, or the shards, or AutoGPTQ's file -- never any other ``*.safetensors``
in the folder; an index that points outside the folder is refused. End to end, a stray
safetensors file next to the weights changes nothing the engine loads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.errors import UnsupportedModelError
from nybble.model_files import model_weight_files


def _folder(tmp_path: Path, *names: str, index: dict[str, str] | None = None,
            quantize_config: dict | None = None) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for name in names:
        (folder / name).write_bytes(b"")
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    if quantize_config is not None:
        (folder / "quantize_config.json").write_text(json.dumps(quantize_config))
    return folder


def _names(folder: Path) -> list[str]:
    return [str(Path(p).relative_to(folder)) for p in model_weight_files(str(folder))]


def test_model_safetensors_and_nothing_else(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "model.safetensors", "reference_outputs.safetensors",
                     "adapter_model.safetensors", "model-00001-of-00002.safetensors")
    assert _names(folder) == ["model.safetensors"]


def test_the_index_names_the_files(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "a.safetensors", "b.safetensors", "stray.safetensors",
                     "model.safetensors",
                     index={"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"})
    assert _names(folder) == ["a.safetensors", "b.safetensors"]


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd",
                                 "sub/../../outside.safetensors", ".."])
def test_an_index_pointing_outside_the_folder_is_refused(tmp_path: Path, bad: str) -> None:
    (tmp_path / "outside.safetensors").write_bytes(b"")
    folder = _folder(tmp_path, "a.safetensors", index={"x": "a.safetensors", "y": bad})
    with pytest.raises(UnsupportedModelError) as info:
        model_weight_files(str(folder))
    assert str(info.value) == (f"model.safetensors.index.json must name weight files inside "
                               f"the model folder {str(folder)!r}, got {bad!r}")


def test_a_missing_file_of_the_index_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "a.safetensors", index={"x": "a.safetensors", "y": "gone.st"})
    with pytest.raises(UnsupportedModelError, match=r"missing \['gone.st'\]"):
        model_weight_files(str(folder))


def test_shards_without_an_index(tmp_path: Path) -> None:
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    folder = _folder(tmp_path, *reversed(shards), "extra.safetensors")
    assert _names(folder) == shards
    (folder / shards[1]).unlink()
    with pytest.raises(UnsupportedModelError, match="missing \\['model-00002-of-00003"):
        model_weight_files(str(folder))


def test_autogptq_names(tmp_path: Path) -> None:
    named = _folder(tmp_path, "my-quant.safetensors", "other.safetensors",
                    quantize_config={"model_file_base_name": "my-quant"})
    assert _names(named) == ["my-quant.safetensors"]
    shutil.rmtree(named)
    default = _folder(tmp_path, "gptq_model-4bit-128g.safetensors", "other.safetensors",
                      quantize_config={"model_file_base_name": None})
    assert _names(default) == ["gptq_model-4bit-128g.safetensors"]
    shutil.rmtree(default)
    per_channel = _folder(tmp_path, "gptq_model-4bit--1g.safetensors", "x.safetensors")
    assert _names(per_channel) == ["gptq_model-4bit--1g.safetensors"]


@pytest.mark.parametrize("files,fragment", [
    (["pytorch_model.bin"], "only pickle checkpoints (refused: they can run code)"),
    (["reference_outputs.safetensors"], "only ['reference_outputs.safetensors'] (not weight"),
    ([], "no weight files"),
])
def test_no_weights_is_one_clear_error(tmp_path: Path, files: list[str], fragment: str) -> None:
    folder = _folder(tmp_path, *files)
    with pytest.raises(UnsupportedModelError) as info:
        model_weight_files(str(folder))
    assert str(info.value).startswith("model folder must contain model.safetensors, "
                                      "model-*-of-*.safetensors shards or "
                                      "model.safetensors.index.json, found ")
    assert fragment in str(info.value)


def test_the_engine_ignores_a_stray_safetensors_file(tmp_path: Path) -> None:
    folder = tmp_path / "stories"
    shutil.copytree(DEFAULT_MODEL, folder)
    # a tensor of the model's name and the wrong shape: loading it would fail
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)},
              str(folder / "reference_outputs.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    got = LLM(str(folder)).generate("The dog", params, use_tqdm=False)[0].outputs[0].text
    want = LLM().generate("The dog", params, use_tqdm=False)[0].outputs[0].text
    assert got == want
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../stories/model.safetensors"}}))
    with pytest.raises(UnsupportedModelError, match="must name weight files inside"):
        LLM(str(folder))
