"""``nybble plan MODEL``: print the memory plan of a model folder or GGUF file on a GPU of a
given size.

Reads ``config.json`` and the safetensors headers only, or a GGUF file's metadata and tensor
table (no weights are loaded, no GPU is needed); see :mod:`nybble.plan.planner` for what is computed and how it matches the engine.
"""
from __future__ import annotations

import argparse

from nybble.config import DEFAULT_MODEL, KV_CACHE_DTYPE_FLAG_CHOICES, canonical_kv_cache_dtype
from nybble.engine_args import parse_bytes


_GPU_MEMORY = parse_bytes("16GiB")
"""``--gpu-memory``'s default."""


def _gpu_memory(text: str) -> int:
    """``--gpu-memory``: a size (:func:`~nybble.engine_args.parse_bytes`) of at least 1 KiB;
    a bare number under that (``24``: bytes, surely meant as GiB) gets the unit it meant."""
    size = parse_bytes(text)
    if size < 1024:
        bare = text.strip().replace(".", "", 1).isdigit()
        hint = f"; did you mean {text.strip()}GiB?" if bare else ""
        raise argparse.ArgumentTypeError(
            f"must be a size of at least 1KiB such as 24GiB, got {text!r} ({size} bytes"
            + (": a number without a unit is bytes" if bare else "") + hint + ")")
    return size


def _fraction(text: str) -> float:
    """``--gpu-memory-utilization``: a number in ``(0, 1]``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1] such as 0.9, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan", help="memory plan: weights, KV cache, sequences that fit on a GPU",
        description="Plan a model's memory on a GPU: weight bytes (exact for the checkpoint's "
                    "quantization), KV-cache bytes per token, how many sequences fit, the "
                    "longest context, and what to change when nothing fits. Uses the "
                    "engine's own KV-pool sizing; loads no weights.")
    p.add_argument("model", metavar="MODEL", nargs="?", default=DEFAULT_MODEL,
                   help="model folder (config.json + *.safetensors) or a .gguf file; default: "
                        "the bundled stories260k model")
    p.add_argument("--gpu-memory", type=_gpu_memory, default=_GPU_MEMORY,
                   help="memory of one GPU, e.g. 24GiB (default: 16GiB)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence, prompt + output (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=list(KV_CACHE_DTYPE_FLAG_CHOICES),
                   type=canonical_kv_cache_dtype,
                   help="KV-cache storage (auto: the serving dtype)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs to split the model over, as `nybble serve --tensor-parallel-size` "
                        "shards it (per-rank weights and KV heads)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="serving dtype (auto: the checkpoint's, float32 becomes float16, as "
                        "the engine does on a GPU)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="the fraction of the GPU the engine may hold, weights included, as "
                        "`nybble serve --gpu-memory-utilization` (default: 90%% of the memory "
                        "free after the weights)")
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                   help="tokens per KV-cache block")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit code 0, or 1 when no sequence of ``--max-model-len`` fits."""
    from nybble.model_files import check_model_dir, config_folder, is_gguf

    check_model_dir(args.model)
    import torch

    from nybble.models.hf_config import load_hf_config
    from nybble.models.loader import resolve_dtype
    from nybble.models.shape import ModelShape
    from nybble.plan.planner import PlanRequest, format_plan, plan_memory
    from nybble.plan.weights import checkpoint_tensors, gguf_tensors

    hf_config = load_hf_config(config_folder(args.model))
    dtype = str(resolve_dtype(args.dtype, hf_config, torch.device("cuda"))).replace("torch.", "")
    request = PlanRequest(args.gpu_memory, args.max_model_len, args.kv_cache_dtype,
                          args.tensor_parallel_size, dtype, args.block_size,
                          args.gpu_memory_utilization)
    tensors = gguf_tensors(args.model) if is_gguf(args.model) else checkpoint_tensors(args.model)
    plan = plan_memory(ModelShape.from_hf_config(hf_config), tensors,
                       int(getattr(hf_config, "max_position_embeddings", 2048)), request)
    defaults = [name for name, value, default in (
        ("model", args.model, DEFAULT_MODEL), ("--gpu-memory", args.gpu_memory, _GPU_MEMORY),
        ("--kv-cache-dtype", args.kv_cache_dtype, "auto"),
        ("--max-model-len", args.max_model_len, None)) if value == default]
    print(format_plan(plan, args.model, defaults))
    return 0 if plan.num_sequences else 1
