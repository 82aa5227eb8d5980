"""Start-up checks of the engine: a KV pool larger than memory is one line naming the bytes
(before anything is allocated); the default CPU pool holds one whole sequence; a pool smaller
than the model's context lowers ``max_model_len`` (a user-set one that does not fit is an
error); ``--max-logprobs`` above the vocabulary is refused."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from nybble.cli import main
from nybble.config import CacheConfig
from nybble.models.shape import ModelShape
from nybble.runtime.worker.kv_plan import default_cpu_kv_budget, plan_kv_cache
from nybble.sampling_params import SamplingParams
from tests.runtime.engine_helpers import make_engine, run_requests

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


def test_the_default_cpu_pool_holds_one_whole_8k_sequence() -> None:
    # SmolLM2-135M's geometry: 30 layers x 3 KV heads x 64, float32 -> 46080 bytes a token;
    # 256 MiB holds only 5824 tokens of its 8192-token context
    smol = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3,
                      head_dim=64, vocab_size=49152)
    spec = plan_kv_cache(CacheConfig(), smol, torch.float32, torch.device("cpu"), 8192)
    assert spec.num_blocks == 512 and spec.total_bytes == 8192 * 46080
    small = plan_kv_cache(CacheConfig(), SHAPE, torch.float32, torch.device("cpu"), 512)
    assert small.total_bytes == (256 << 20) // BLOCK_BYTES * BLOCK_BYTES  # the floor stays


def test_the_cpu_default_never_takes_more_than_a_quarter_of_memory() -> None:
    layout = plan_kv_cache(CacheConfig(num_gpu_blocks=1), SHAPE, torch.float32,
                           torch.device("cpu")).layout
    assert default_cpu_kv_budget(layout, 10**9, 8 << 30) == 2 << 30
    assert default_cpu_kv_budget(layout, 2048, 8 << 30) == 256 << 20


def test_a_pool_smaller_than_the_models_context_lowers_max_model_len(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nybble.runtime.engine.engine_core"):
        engine = make_engine(num_gpu_blocks=4)
    (record,) = [r for r in caplog.records if "max_model_len lowered" in r.getMessage()]
    assert record.getMessage().startswith(
        "max_model_len lowered from 512 (the model's context) to 64: the KV cache holds 64 "
        "tokens (4 blocks x 16)")
    assert engine.input_processor.limits.max_model_len == 64
    # max_tokens unset is the rest of the (fitted) context: served, not refused
    out = run_requests(engine, [("r", [1, 403, 407], SamplingParams(max_tokens=None,
                                                                     ignore_eos=True))])["r"]
    assert len(out.outputs[0].token_ids) == 61
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nybble.runtime.engine.engine_core"):
        make_engine(num_gpu_blocks=32)   # exactly 512 tokens: nothing to lower
    assert not [r for r in caplog.records if "max_model_len lowered" in r.getMessage()]


def test_a_user_set_max_model_len_that_does_not_fit_is_a_start_up_error() -> None:
    with pytest.raises(ValueError, match=r"^max_model_len must fit in the KV cache: 512 tokens "
                                         r"were asked for, but the pool holds 64 tokens"):
        make_engine(num_gpu_blocks=4, max_model_len=512)
    assert make_engine(num_gpu_blocks=4, max_model_len=64).input_processor.limits \
        .max_model_len == 64


def test_max_logprobs_above_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^max_logprobs must be <= 512 \(the model's "
                                         r"vocabulary\), got 513$"):
        make_engine(max_logprobs=513)
    assert make_engine(max_logprobs=512).input_processor.limits.max_logprobs == 512
