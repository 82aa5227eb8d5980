"""The engine flags shared by ``nybble serve``, ``generate`` and ``bench`` (vLLM's names)."""
from __future__ import annotations

import argparse

from nybble.config import (
    CPU_ACTIVATION_DTYPES,
    CPU_PREFILL_GEMMS,
    DEFAULT_MODEL,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPE_FLAG_CHOICES,
    MAX_LORA_RANKS,
    EngineConfig,
    canonical_kv_cache_dtype,
)
from nybble.threads import add_threads_arg


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1e9"`` or plain bytes -> int bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "b": 1}
    lower = text.strip().lower()
    try:
        for suffix, mult in units.items():
            if lower.endswith(suffix):
                return int(float(lower[: -len(suffix)]) * mult)
        return int(float(lower))
    except (ValueError, OverflowError):   # NOTE: int(float("inf")) overflows
        raise argparse.ArgumentTypeError(
            f"must be a size in bytes such as 268435456, 256MiB or 1GiB, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False,
                    lora: bool = True) -> None:
    """Add the engine flags to ``parser``.

    Args:
        model_positional: take the model as an optional positional argument (``nybble serve
            [MODEL]``) as well as ``--model``.
        lora: add the LoRA flags (``nybble serve`` has adapters to pick; ``generate`` and
            ``bench`` have none, so the flags would do nothing there).
    """
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="model folder (Hugging Face layout) or GGUF file; default: "
                                 "the bundled stories260k model")
    parser.add_argument("--model", default=None,
                        help="model folder (Hugging Face layout) or .gguf file (config, "
                             "tokenizer and chat template from its metadata); default: the "
                             "bundled stories260k model (nybble.DEFAULT_MODEL)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the model; a GGUF file's metadata)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "float16", "bfloat16"],
                        help="weight and activation dtype (auto: the checkpoint's on GPU, "
                             "float32 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence in tokens, prompt + output "
                             "(default: the model's max_position_embeddings)")
    parser.add_argument("--quantization", "-q", default=None,
                        choices=["awq", "gptq", "compressed-tensors", "gguf"],
                        help="quantization method; must match the checkpoint "
                             "(default: detected from config.json's quantization_config, "
                             "or gguf for a .gguf file)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (auto: cuda when available)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampler for requests without their own seed")
    parser.add_argument("--cpu-activation-dtype", default="auto",
                        choices=list(CPU_ACTIVATION_DTYPES),
                        help="activations of the CPU's quantized matmuls: int16 (15-bit "
                             "integers per block of 32, AVX-512 VNNI or AVX2 integer dot "
                             "products; finer than bfloat16; on AVX2 without VNNI: faster "
                             "single-stream decode of 4-bit models), int8 (8-bit per block, llama.cpp's "
                             "choice: fastest with many sequences, coarsest), bfloat16 "
                             "(AVX-512 BF16 dot products), float32 (exact: reproduces the "
                             "dequantized model's float32 outputs); auto: int16 with VNNI, "
                             "else bfloat16 with AVX-512 BF16, else float32")
    parser.add_argument("--cpu-prefill-gemm", default="auto", choices=list(CPU_PREFILL_GEMMS),
                        help="quantized matmuls of prefill chunks (at least 128 tokens) on "
                             "the CPU: bfloat16 (dequantize the weight to bfloat16, then a "
                             "bfloat16 GEMM: AMX tiles through oneDNN), float32 (dequantize "
                             "to float32, then a float32 GEMM: exact), kernel (the "
                             "--cpu-activation-dtype kernel for every step); auto: bfloat16 "
                             "with AMX-BF16 (from 128 tokens) or with AVX-512 BF16 under "
                             "int16/int8 activations (from 256), else float32 where the "
                             "integer-dot kernel runs its AVX2 loop; kernel when the "
                             "activations are float32")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="largest logprobs / top_logprobs a request may ask for")
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                        help="tokens per KV-cache block")
    parser.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="number of KV-cache blocks (overrides --kv-cache-memory)")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help="KV-cache budget in bytes, e.g. 256MiB (default: 256MiB on CPU, "
                             "grown to one max-model-len sequence within a quarter of RAM; "
                             "90%% of free memory on GPU; a model context that does not fit "
                             "lowers max-model-len)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="on a GPU, the fraction of its total memory the engine may hold, "
                             "weights included (vLLM's flag; default: the pool gets 90%% of "
                             "the memory free after the weights); ignored on the CPU")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=list(KV_CACHE_DTYPE_FLAG_CHOICES),
                        type=canonical_kv_cache_dtype,
                        help="KV-cache storage: auto (the model's dtype; bfloat16 for a "
                             "quantized model on the CPU unless --cpu-activation-dtype is "
                             "float32), bfloat16 or float32 (2 or 4 bytes per element), int8 "
                             "or fp8_e4m3 (also fp8; one byte per element, per-head scales: "
                             "about 2x a 16-bit cache's tokens)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="reuse the KV cache of full blocks whose token prefix was "
                             "computed before (automatic prefix caching; default: on, as in "
                             "vLLM V1; --no-enable-prefix-caching turns it off)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="most sequences in one engine step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one engine step (decode + prefill chunks)")
    parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                        action="store_false",
                        help="admit a prompt only when it fits the step's token budget whole")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "cpu", "torch", "triton"],
                        help="attention kernels (auto: triton on CUDA, cpu on the CPU: the "
                             "Cython decode kernel; torch: the pure-torch reference)")
    parser.add_argument("--compilation-level", "-O", type=int, default=0, choices=[0, 3],
                        help="0: eager PyTorch; 3: torch.compile the dense segments between "
                             "attentions (compiles on first use: tens of seconds on a CPU)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step op by op (by default, on CUDA, decode steps "
                             "replay graphs captured at start-up for batch-size buckets, and "
                             "on the CPU a float32 model's decode steps of up to 32 "
                             "sequences, and every step of a small one, run as one fused C "
                             "call)")
    parser.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                        metavar="N",
                        help="batch sizes to capture CUDA graphs for (default: 1 2 4 8 16 "
                             "24 ... up to --max-num-seqs, at most 512)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s JSON keys: {"method": "ngram", '
                             '"num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                             '"prompt_lookup_min": 1} or {"model": "<draft folder>", '
                             '"num_speculative_tokens": 3} (default: off)')
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many ranks (Megatron-style tensor "
                             "parallelism; one GPU each on CUDA, gloo processes on CPU)")
    parser.add_argument("--distributed-executor-backend", default="mp",
                        choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
                        help="how the ranks 1..N-1 run: mp (worker processes on this "
                             "machine) or ray (Ray actors; RAY_ADDRESS names a cluster, else "
                             "a local one is started)")
    if lora:
        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (PEFT folders) on the base model's "
                                 "q/k/v/o and gate/up/down projections; requests of different "
                                 "adapters and of the base run in one batch (docs/lora.md)")
        parser.add_argument("--max-loras", type=int, default=1,
                            help="with --enable-lora: the most distinct adapters in one step "
                                 "(device slots); a request whose adapter finds every slot in "
                                 "use waits")
        parser.add_argument("--max-lora-rank", type=int, default=16,
                            choices=list(MAX_LORA_RANKS),
                            help="with --enable-lora: the largest adapter rank served (an "
                                 "adapter of a higher rank is refused)")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="with --enable-lora: adapters kept loaded in host memory (an "
                                 "LRU cache; default: --max-loras)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="do not log the periodic stats line")
    add_threads_arg(parser)


def engine_config_from_args(args: argparse.Namespace,
                            served_model_name: str | None = None) -> EngineConfig:
    """Build the :class:`EngineConfig` from parsed :func:`add_engine_args` flags."""
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise ValueError(f"the model is given twice, as MODEL {tag!r} and as --model "
                         f"{args.model!r}: give one")
    model = tag or args.model or DEFAULT_MODEL
    return EngineConfig.from_kwargs(
        model=model, tokenizer=args.tokenizer, dtype=args.dtype,
        max_model_len=args.max_model_len, quantization=args.quantization, device=args.device,
        seed=args.seed, served_model_name=served_model_name, max_logprobs=args.max_logprobs,
        cpu_activation_dtype=args.cpu_activation_dtype,
        cpu_prefill_gemm=args.cpu_prefill_gemm, block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        attention_backend=args.attention_backend, disable_log_stats=args.disable_log_stats,
        threads=args.threads, compilation_level=args.compilation_level,
        enforce_eager=args.enforce_eager,
        speculative_config=getattr(args, "speculative_config", None),
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        cuda_graph_sizes=None if args.cuda_graph_sizes is None else
        tuple(args.cuda_graph_sizes),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1), max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None))
