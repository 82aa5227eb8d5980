"""Start-up checks of the engine: a KV pool larger than memory is one line naming the bytes
(before anything is allocated); a pool smaller than one ``max_model_len`` sequence is a
warning saying what cannot be served; ``--max-logprobs`` above the vocabulary is refused."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from nybble.cli import main
from nybble.config import CacheConfig
from nybble.models.shape import ModelShape
from nybble.runtime.worker.kv_cache import plan_kv_cache
from tests.runtime.engine_helpers import make_engine

# stories260k's geometry: 5 layers, 4 KV heads of 8 -> 2 * 5 * 16 * 4 * 8 * 4 = 20480 bytes
SHAPE = ModelShape(num_layers=5, hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=8,
                   vocab_size=512)
BLOCK_BYTES = 20480
MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("cache,flag", [
    (CacheConfig(num_gpu_blocks=MEMORY // BLOCK_BYTES + 1), "num_gpu_blocks"),
    (CacheConfig(kv_cache_memory=MEMORY + BLOCK_BYTES), "kv_cache_memory"),
])
def test_a_pool_larger_than_memory_is_refused_naming_the_bytes(cache: CacheConfig,
                                                               flag: str) -> None:
    with pytest.raises(ValueError) as info:
        plan_kv_cache(cache, SHAPE, torch.float32, torch.device("cpu"))
    blocks = MEMORY // BLOCK_BYTES + 1
    assert str(info.value) == (
        f"{flag} must fit in memory: {blocks} blocks x {BLOCK_BYTES} bytes = "
        f"{blocks * BLOCK_BYTES} bytes of KV cache, but this machine's memory is {MEMORY} "
        f"bytes (at most {MEMORY // BLOCK_BYTES} blocks)")
    fits = plan_kv_cache(CacheConfig(num_gpu_blocks=MEMORY // BLOCK_BYTES), SHAPE,
                         torch.float32, torch.device("cpu"))
    assert fits.bytes_per_block == BLOCK_BYTES


def test_the_cli_says_it_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--num-gpu-blocks", str(10**12)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nybble generate: error: num_gpu_blocks must "
                                               "fit in memory: 1000000000000 blocks x 20480 "
                                               "bytes = 20480000000000000 bytes")


def test_a_pool_smaller_than_one_sequence_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nybble.runtime.engine.engine_core"):
        make_engine(num_gpu_blocks=4)
    (record,) = [r for r in caplog.records if "KV cache holds" in r.getMessage()]
    assert record.getMessage().startswith(
        "the KV cache holds 64 tokens (4 blocks x 16), fewer than max_model_len 512: a "
        "request whose prompt + max_tokens exceeds 64 tokens cannot be served")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nybble.runtime.engine.engine_core"):
        make_engine(num_gpu_blocks=32)   # exactly 512 tokens: no warning
    assert not [r for r in caplog.records if "KV cache holds" in r.getMessage()]


def test_max_logprobs_above_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^max_logprobs must be <= 512 \(the model's "
                                         r"vocabulary\), got 513$"):
        make_engine(max_logprobs=513)
    assert make_engine(max_logprobs=512).input_processor.limits.max_logprobs == 512
