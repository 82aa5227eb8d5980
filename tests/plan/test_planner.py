"""``nybble plan``: the engine's own KV sizing (same functions, same blocks as a real
allocation), weight bytes from safetensors headers checked against the loaded model and the
safetensors library, tensor parallelism, the CLI's output and its advice when nothing fits."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors import safe_open

from nybble.cli import main
from nybble.config import DEFAULT_MODEL, CacheConfig
from nybble.models.hf_config import load_hf_config
from nybble.models.shape import ModelShape
from nybble.plan.planner import PlanRequest, kv_layout, plan_memory
from nybble.plan.weights import checkpoint_tensors, llama_gptq_tensors, weight_bytes
from nybble.runtime.worker.kv_plan import blocks_in_budget, plan_kv_cache
from tests.conftest import shared_path
from tests.runtime.engine_helpers import make_engine

SHAPE = ModelShape.from_hf_config(load_hf_config(DEFAULT_MODEL))  # 5 layers, 4 KV heads of 8
TENSORS = checkpoint_tensors(DEFAULT_MODEL)


@pytest.mark.parametrize("kv_dtype,elem", [("auto", 4), ("bfloat16", 2), ("int8", 1),
                                           ("fp8_e4m3", 1)])
def test_the_planner_sizes_the_pool_the_engine_allocates(kv_dtype: str, elem: int) -> None:
    """A real engine on the CPU with a byte budget: the planner's layout and block count are
    the allocation's, tensor by tensor."""
    budget = 3 << 20
    engine = make_engine(kv_cache_memory=budget, kv_cache_dtype=kv_dtype).engine_core
    layout = kv_layout(SHAPE, PlanRequest(gpu_memory=0, kv_cache_dtype=kv_dtype,
                                          dtype="float32"))
    assert layout.bytes_per_token == 2 * 5 * 4 * 8 * elem  # written out: K,V x L x Hkv x D
    blocks = blocks_in_budget(budget, layout)
    assert engine.kv_spec.num_blocks == blocks == budget // (16 * layout.bytes_per_token)
    allocated = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    assert allocated == blocks * layout.bytes_per_block == engine.kv_spec.total_bytes


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("gpu_gib", [1, 3])
def test_the_planner_and_the_engine_agree_on_a_gpu(kv_dtype: str, gpu_gib: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on a GPU with ``G - weights`` free after loading (the CUDA query faked)
    plans the same blocks as ``nybble plan --gpu-memory G``."""
    gpu = gpu_gib << 30
    plan = plan_memory(SHAPE, TENSORS, 512, PlanRequest(gpu, 256, kv_dtype, dtype="float16"))
    free = gpu - plan.weight_bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, gpu))
    spec = plan_kv_cache(CacheConfig(kv_cache_dtype=kv_dtype), SHAPE, torch.float16,
                         torch.device("cuda"))
    assert spec.num_blocks == plan.num_blocks == int(free * 0.9) // spec.bytes_per_block
    assert spec.bytes_per_block == 16 * plan.kv_bytes_per_token
    assert plan.num_sequences == plan.num_blocks // 16  # 256 tokens = 16 blocks
    assert plan.max_context == 512  # capped by max_position_embeddings


@pytest.mark.parametrize("fraction", [0.5, 0.95])
def test_gpu_memory_utilization_is_vllms_share_of_the_whole_gpu(
        fraction: float, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--gpu-memory-utilization F``: the engine may hold ``F`` of the GPU, weights included,
    so the pool gets ``F * total - weights`` (the CUDA query faked), as ``nybble plan``
    computes it."""
    gpu = 1 << 30
    request = PlanRequest(gpu, 256, dtype="float16", gpu_memory_utilization=fraction)
    plan = plan_memory(SHAPE, TENSORS, 512, request)
    free = gpu - plan.weight_bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, gpu))
    spec = plan_kv_cache(CacheConfig(gpu_memory_utilization=fraction), SHAPE, torch.float16,
                         torch.device("cuda"))
    want = (int(gpu * fraction) - plan.weight_bytes) // spec.bytes_per_block
    assert spec.num_blocks == plan.num_blocks == want
    assert main(["plan", "--gpu-memory", "1GiB", "--gpu-memory-utilization", str(fraction)]) == 0
    assert f"MiB: {fraction:g} of the GPU less the weights)" in capsys.readouterr().out
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            main(["plan", "--gpu-memory-utilization", bad])
        assert "must be a fraction in (0, 1]" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_too_small_a_gpu_memory_utilization_is_advised_up() -> None:
    """Nothing fits under 0.005 of 64 MiB: the advice names the smallest share (hundredths)
    that holds the weights and one 512-token sequence, and that share really fits."""
    gpu = 64 << 20
    plan = plan_memory(SHAPE, TENSORS, 512, PlanRequest(gpu, dtype="float16",
                                                        gpu_memory_utilization=0.005))
    assert plan.num_sequences == 0
    need = plan.weight_bytes + 32 * 16 * plan.kv_bytes_per_token   # 512 tokens = 32 blocks
    share = -(-need * 100 // gpu) / 100
    assert f"--gpu-memory-utilization {share:.2f} or more: the weights and one sequence of " \
           f"512 tokens fit" in plan.advice
    fits = plan_memory(SHAPE, TENSORS, 512, PlanRequest(gpu, dtype="float16",
                                                        gpu_memory_utilization=share))
    assert fits.num_sequences >= 1


def test_gpu_memory_utilization_is_ignored_on_the_cpu_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nybble.runtime.worker.kv_plan"):
        spec = plan_kv_cache(CacheConfig(gpu_memory_utilization=0.5), SHAPE, torch.float32,
                             torch.device("cpu"), 512)
    plain = plan_kv_cache(CacheConfig(), SHAPE, torch.float32, torch.device("cpu"), 512)
    assert spec.num_blocks == plain.num_blocks
    assert any("ignored on the CPU" in r.getMessage() for r in caplog.records)


def test_weight_bytes_equal_the_loaded_model() -> None:
    engine = make_engine(num_gpu_blocks=8).engine_core
    assert weight_bytes(TENSORS, "float32") == engine.loaded.weight_bytes
    assert weight_bytes(TENSORS, "float16") == engine.loaded.weight_bytes // 2


def test_weight_bytes_of_a_gptq_checkpoint_from_the_library() -> None:
    """Packed int32 tensors count as stored, floating ones at the serving dtype; the reference
    sums the tensors the safetensors library loads."""
    gptq = shared_path("fixtures", "quant", "tiny-llama-gptq-4bit-g32")
    path = os.path.join(gptq, "gptq_model-4bit-32g.safetensors")
    want = 0
    with safe_open(path, "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            want += t.numel() * (2 if t.is_floating_point() else t.element_size())
    assert weight_bytes(checkpoint_tensors(gptq), "float16") == want


def test_tensor_parallel_splits_kv_heads_and_matrices() -> None:
    one = plan_memory(SHAPE, TENSORS, 512, PlanRequest(1 << 30, dtype="float16"))
    two = plan_memory(SHAPE, TENSORS, 512, PlanRequest(1 << 30, tensor_parallel_size=2,
                                                       dtype="float16"))
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    norms = sum(t.numel * 2 for t in TENSORS.values() if len(t.shape) == 1)
    matrices = sum(t.numel * 2 for t in TENSORS.values() if len(t.shape) >= 2)
    assert two.weight_bytes == norms + matrices // 2
    eight = plan_memory(SHAPE, TENSORS, 512, PlanRequest(1 << 30, tensor_parallel_size=8,
                                                         dtype="float16"))
    assert eight.kv_bytes_per_token == two.kv_bytes_per_token // 2  # one head each, replicated
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1 and divide, or be "
                                         "a multiple of, the model's 4 KV heads, got 3"):
        plan_memory(SHAPE, TENSORS, 512, PlanRequest(1 << 30, tensor_parallel_size=3))


def test_a_7b_shape_matches_its_hand_count() -> None:
    """Llama-2-7B's shape: 6,738,415,616 parameters; KV 512 KiB a token in fp16; the GPTQ
    4-bit g128 layout's bytes written out per projection."""
    cfg = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "vocab_size": 32000}
    fp16 = llama_gptq_tensors(cfg, None)
    assert sum(t.numel for t in fp16.values()) == 6_738_415_616
    int4 = weight_bytes(llama_gptq_tensors(cfg, 4, 128), "float16")
    per_layer = 0
    for k, n in [(4096, 4096)] * 4 + [(4096, 11008)] * 2 + [(11008, 4096)]:
        per_layer += k * n // 2 + (k // 128) * (n // 8) * 4 + (k // 128) * n * 2 + k * 4
    assert int4 == 32 * (per_layer + 2 * 4096 * 2) + 2 * 32000 * 4096 * 2 + 4096 * 2


def test_cli_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", "64MiB", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    weights = weight_bytes(TENSORS, "float16")  # auto on a GPU: the fp32 checkpoint as fp16
    per_token = 2 * 5 * 4 * 8 * 2
    blocks = int(((64 << 20) - weights) * 0.9) // (16 * per_token)
    assert f"weights          {weights} bytes" in out
    assert f"KV per token     {per_token} bytes" in out
    assert f"KV pool          {blocks} blocks x 16 tokens = {blocks * 16} tokens" in out
    assert f"sequences        {blocks // 16} of 256 tokens fit at once" in out
    assert "longest context  512 tokens" in out and "nothing fits" not in out
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", "64MiB", "--kv-cache-dtype", "int8",
                 "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "KV cache dtype   int8 (per-head scales): 2.00x the tokens of a bfloat16 cache" in out
    assert f"KV per token     {per_token // 2} bytes" in out
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", "64MiB", "--kv-cache-dtype", "bfloat16",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "KV cache dtype   bfloat16: 2.00x the tokens of a float32 cache" in out
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", "64MiB", "--kv-cache-dtype", "float32",
                 "--dtype", "float32"]) == 0
    assert "KV cache dtype   float32: 1.00x the tokens of a float32 cache" in \
        capsys.readouterr().out
    assert f"KV per token     {per_token} bytes" in out


def test_cli_says_what_to_change_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    weights = weight_bytes(TENSORS, "float16")
    gpu = weights + 100_000  # 90,000 bytes of KV: 8 blocks of 16 x 640 bytes = 128 tokens
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", str(gpu),
                 "--max-model-len", "256"]) == 1
    out = capsys.readouterr().out
    assert "sequences        0 of 256 tokens fit at once" in out
    assert "longest context  128 tokens for one sequence" in out
    assert "  - lower --max-model-len to 128 or less" in out
    assert "  - --kv-cache-dtype fp8_e4m3: 1 sequence(s) of 256 tokens fit" in out
    # 2 ranks: half the KV heads each (320 bytes a token), 90,000 + half the matrices' bytes
    assert "  - --tensor-parallel-size 2: 3 sequence(s) fit per GPU set" in out
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", "100000"]) == 1
    assert "the weights alone" in capsys.readouterr().out


def test_cli_refuses_a_bad_kv_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", DEFAULT_MODEL, "--kv-cache-dtype", "fp4"])
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'fp4'" in err
    assert all(name in err.split("choose from")[1]
               for name in ("auto", "fp8_e4m3", "int8", "'fp8'"))   # vLLM's alias listed too


def test_cli_plans_the_bundled_model_without_a_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpu-memory", "64MiB"]) == 0
    assert "stories260k" in capsys.readouterr().out


def test_a_gpu_memory_without_a_unit_is_refused_when_it_cannot_be_bytes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--gpu-memory 24`` is 24 bytes: refused with the unit it probably meant."""
    with pytest.raises(SystemExit):
        main(["plan", "--gpu-memory", "24"])
    assert "did you mean 24GiB?" in capsys.readouterr().err
    for text in ("0GiB", "512B", "inf"):     # a unit given: no unit suggested; inf: no crash
        with pytest.raises(SystemExit):
            main(["plan", "--gpu-memory", text])
        err = capsys.readouterr().err
        assert "argument --gpu-memory: must be a size" in err and "did you mean" not in err
    assert main(["plan", "--gpu-memory", str(64 << 20)]) == 0   # bytes, spelled out
    out = capsys.readouterr().out
    assert "GPU memory       0.06 GiB" in out
    assert "(the most --max-model-len can be here)" in out


def test_the_plan_marks_what_was_left_at_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Each value the user did not set says so and names its flag; set ones say nothing."""
    assert main(["plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("stories260k (default: the bundled model)")
    assert "GPU memory       16.00 GiB (default; set with --gpu-memory)" in lines
    assert "KV cache dtype   auto (float16) (default; set with --kv-cache-dtype)" in lines
    assert any(line.startswith("sequences ") and line.endswith(
        "512 tokens fit at once (the model's max_position_embeddings; set with "
        "--max-model-len)") for line in lines)
    assert main(["plan", DEFAULT_MODEL, "--gpu-memory", "24GiB", "--kv-cache-dtype", "int8",
                 "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "set with" not in out   # (the model given is still the bundled one)


def test_the_docs_gpu_table_is_the_planners() -> None:
    """docs/memory-planner.md's table is what ``benchmarks/plan_gpu_table.py`` prints."""
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    from plan_gpu_table import table

    with open(os.path.join(root, "docs", "memory-planner.md"), encoding="utf-8") as f:
        assert table() in f.read()


def test_a_gguf_file_is_planned_from_its_tensor_table(capsys: pytest.CaptureFixture[str]) -> None:
    """``nybble plan FILE.gguf``: block-quantized tensors count their bytes as stored, float
    tensors at the serving dtype; the reference is gguf-py's own tensor table."""
    from gguf import GGUFReader

    from nybble.plan.weights import gguf_tensors

    path = shared_path("fixtures", "gguf", "stories3m-Q4_K_M.gguf")
    reader = GGUFReader(path)
    floats = {"F32", "F16", "BF16"}
    expected = sum(int(t.n_elements) * 2 if t.tensor_type.name in floats else int(t.n_bytes)
                   for t in reader.tensors)
    assert any(t.tensor_type.name not in floats for t in reader.tensors)
    assert weight_bytes(gguf_tensors(path), "float16") == expected
    assert main(["plan", path, "--gpu-memory", "64MiB", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert path in out and f"weights          {expected} bytes" in out
