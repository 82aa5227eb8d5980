"""Adapter folders nybble refuses, each with a message that says what was wrong and what is
allowed (nybble.lora_files, torch-free), and the scale and ranks it reads from PEFT's config;
the adapters are saved by PEFT itself."""
from __future__ import annotations

import math
import os
import shutil

import pytest
from nybble.config import DEFAULT_MODEL
from nybble.errors import InvalidRequestError, LoRAAdapterError
from nybble.lora_files import BaseTargets, read_adapter

from tests.conftest import shared_path
from tests.lora.adapters import edit_config, make_adapter

BUNDLED = BaseTargets.of(num_layers=5, hidden=64, num_heads=8, num_kv_heads=4, head_dim=8,
                         intermediate=172)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    return make_adapter(DEFAULT_MODEL, str(tmp_path_factory.mktemp("good") / "a"), r=8,
                        alpha=16, seed=1, rank_pattern={"down_proj": 4},
                        alpha_pattern={"model.layers.0.self_attn.q_proj": 3})


def test_ranks_and_scales_follow_r_alpha_and_the_patterns(good: str) -> None:
    spec = read_adapter(good, BUNDLED, max_rank=16)
    assert len(spec.modules) == 5 * 7 and spec.max_rank == 8
    by = {(m.layer, m.name): m for m in spec.modules}
    assert by[(1, "q_proj")].rank == 8 and by[(1, "q_proj")].scale == 16 / 8
    assert by[(0, "q_proj")].scale == 3 / 8                 # alpha_pattern, layer 0 only
    assert by[(2, "down_proj")].rank == 4 and by[(2, "down_proj")].scale == 16 / 4


def test_rslora_scale_is_alpha_over_sqrt_r(tmp_path) -> None:
    folder = make_adapter(DEFAULT_MODEL, str(tmp_path / "rs"), r=16, alpha=8, seed=2,
                          use_rslora=True, targets=("v_proj",))
    spec = read_adapter(folder, BUNDLED, max_rank=16)
    assert {m.name for m in spec.modules} == {"v_proj"}
    assert all(math.isclose(m.scale, 8 / 4) for m in spec.modules)


def _copy(good: str, tmp_path, **changes) -> str:
    folder = str(tmp_path / "copy")
    shutil.copytree(good, folder)
    return edit_config(folder, **changes) if changes else folder


@pytest.mark.parametrize("changes,message", [
    ({"use_dora": True}, "DoRA adapters are not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save .* allowed|may only add LoRA"),
    ({"target_modules": ["embed_tokens", "q_proj"]}, "embeddings or the LM head"),
    ({"target_modules": ["c_attn"]}, "c_attn, which this base does not have; allowed: q_proj"),
    ({"peft_type": "IA3"}, "peft_type must be LORA"),
    ({"r": 4}, "rank 8, but r / rank_pattern say 4"),
])
def test_config_refusals(good: str, tmp_path, changes: dict, message: str) -> None:
    with pytest.raises(LoRAAdapterError, match=message) as info:
        read_adapter(_copy(good, tmp_path, **changes), BUNDLED, max_rank=16)
    assert isinstance(info.value, InvalidRequestError) and info.value.param == "lora_path"


def test_rank_above_max_lora_rank_is_refused_with_the_flag_to_raise(good: str) -> None:
    with pytest.raises(LoRAAdapterError, match="above max_lora_rank 4 .*--max-lora-rank"):
        read_adapter(good, BUNDLED, max_rank=4)


def test_a_real_dora_adapter_is_refused(tmp_path) -> None:
    folder = make_adapter(DEFAULT_MODEL, str(tmp_path / "dora"), r=4, alpha=8, seed=3,
                          use_dora=True)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        read_adapter(folder, BUNDLED, max_rank=16)


def test_real_adapters_on_embeddings_and_modules_to_save_are_refused(tmp_path) -> None:
    emb = make_adapter(DEFAULT_MODEL, str(tmp_path / "emb"), r=4, alpha=8, seed=3,
                       targets=("embed_tokens", "q_proj"))
    with pytest.raises(LoRAAdapterError, match="embeddings or the LM head"):
        read_adapter(emb, BUNDLED, max_rank=16)
    saved = make_adapter(DEFAULT_MODEL, str(tmp_path / "mts"), r=4, alpha=8, seed=3,
                         modules_to_save=["lm_head"])
    with pytest.raises(LoRAAdapterError, match="modules_to_save"):
        read_adapter(saved, BUNDLED, max_rank=16)


def test_an_adapter_of_another_base_is_refused_by_its_shapes(tmp_path) -> None:
    other = make_adapter(shared_path("models", "stories3m"), str(tmp_path / "3m"), r=4,
                         alpha=8, seed=4)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        read_adapter(other, BUNDLED, max_rank=16)


def test_not_an_adapter_folder(tmp_path, good: str) -> None:
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        read_adapter(str(tmp_path / "nowhere"), BUNDLED, max_rank=16)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        read_adapter(str(tmp_path / "empty"), BUNDLED, max_rank=16)
    folder = _copy(good, tmp_path)
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(LoRAAdapterError, match="cannot be read"):
        read_adapter(folder, BUNDLED, max_rank=16)
