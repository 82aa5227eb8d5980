"""LoRAConfig and the engine flags of multi-LoRA serving (vLLM's names and defaults)."""
from __future__ import annotations

import argparse

import pytest

from nybble.config import EngineConfig, LoRAConfig
from nybble.engine_args import add_engine_args, engine_config_from_args
from nybble.lora_request import LoRARequest


def test_flags_reach_the_config_with_vllms_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args([])).lora_config
    assert default == LoRAConfig() and not default.enable_lora
    assert (default.max_loras, default.max_lora_rank, default.cpu_loras) == (1, 16, 1)
    lc = engine_config_from_args(parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
         "--max-cpu-loras", "5"])).lora_config
    assert (lc.enable_lora, lc.max_loras, lc.max_lora_rank, lc.cpu_loras) == (True, 3, 64, 5)


@pytest.mark.parametrize("kwargs,message", [
    ({"max_loras": 0}, "max_loras must be an int >= 1"),
    ({"max_lora_rank": 7}, "max_lora_rank must be one of"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras must be >= max_loras \(4\)"),
    ({"enable_lora": True, "speculative_config": {"method": "ngram"}},
     "speculative_config with enable_lora must be None"),
    ({"enable_lora": True, "compilation_level": 3}, "compilation_level with enable_lora"),
])
def test_refused_values_say_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_lora_request_ids_and_cache_roots() -> None:
    a = LoRARequest("a", 1, "/a")
    assert a.cache_salt != 0 and a.cache_salt != LoRARequest("b", 2, "/b").cache_salt
    assert a.cache_salt == LoRARequest("a2", 1, "/a").cache_salt < 2**64
    for bad in ({"lora_int_id": 0}, {"lora_name": ""}):
        with pytest.raises(ValueError):
            LoRARequest(**{"lora_name": "x", "lora_int_id": 1, "lora_path": "/p", **bad})
