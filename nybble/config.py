"""One frozen configuration object that flows down from the CLI / ``LLM(...)`` kwargs.

``EngineConfig`` composes :class:`ModelConfig`, :class:`CacheConfig`,
:class:`SchedulerConfig`, :class:`CompilationConfig` and :class:`ParallelConfig`. Every
field is validated at construction with a message that names the value received and the
allowed range. Nothing mutates a config after it is built;
values derived at start-up live elsewhere: the number of KV blocks in
``nybble.runtime.worker.kv_plan.KVCacheSpec``, the EOS ids and the model's dimensions
(``nybble.models.shape.ModelShape``) in ``nybble.models.loader.LoadedModel``. Which files of a
model folder are the config, the weights and the tokenizer is :mod:`nybble.model_files`'.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from nybble.model_files import (
    TOKENIZER_FILES,
    check_model_dir,
    config_folder,
    file_bytes,
    is_gguf,
    read_json,
)

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "_bundled", "stories260k")
"""Path of the bundled real model (Karpathy's stories260K in Hugging Face Llama format)."""

_DTYPES = ("auto", "float32", "float16", "bfloat16")
CPU_ACTIVATION_DTYPES = ("auto", "int16", "int8", "bfloat16", "float32")
"""What ``ModelConfig.cpu_activation_dtype`` (``--cpu-activation-dtype``) may be."""
CPU_PREFILL_GEMMS = ("auto", "bfloat16", "float32", "kernel")
"""What ``ModelConfig.cpu_prefill_gemm`` (``--cpu-prefill-gemm``) may be."""
_ATTN_BACKENDS = ("auto", "cpu", "torch", "triton")
_QUANT = (None, "awq", "gptq", "compressed-tensors", "gguf")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3", "int8")
"""Allowed ``kv_cache_dtype`` values (vLLM's ``--kv-cache-dtype`` names)."""
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
"""Other names taken for a ``kv_cache_dtype`` (vLLM's ``fp8`` is its e4m3 format)."""
KV_CACHE_DTYPE_FLAG_CHOICES = (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)
"""What the ``--kv-cache-dtype`` flags accept and list (names, then aliases)."""


def canonical_kv_cache_dtype(value: str) -> str:
    """``value`` with an alias of :data:`KV_CACHE_DTYPE_ALIASES` replaced by its name (the
    ``type`` of the ``--kv-cache-dtype`` flags, so ``fp8`` passes their choices)."""
    return KV_CACHE_DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: path of a Hugging Face model folder (config.json + *.safetensors + tokenizer)
            or of a GGUF file (``.gguf``; config and tokenizer from its metadata).
        tokenizer: tokenizer folder; defaults to ``model`` (a GGUF file's side folder).
        dtype: ``auto`` (the checkpoint's ``torch_dtype``; float16 for quantized checkpoints
            on GPU, float32 on CPU), ``float32``, ``float16`` or ``bfloat16``.
        max_model_len: longest sequence (prompt + output, tokens); default: the model's
            ``max_position_embeddings``.
        quantization: force ``awq`` / ``gptq`` / ``compressed-tensors``; must match the
            checkpoint. ``None``: detect from ``quantization_config``.
        device: ``cpu``, ``cuda`` or ``auto`` (cuda when available).
        seed: seed of the global sampling generator (requests without their own seed).
        served_model_name: name reported by the API; default: the folder name.
        cpu_activation_dtype: what the CPU's quantized matmuls turn activations into:
            ``int16`` (15-bit integers per block of 32 inputs, exact integer dot products
            with AVX-512 VNNI, or AVX2's VPMADDUBSW: finer than bfloat16 and the fastest
            near-exact path at one sequence),
            ``int8`` (8-bit per block of 32, llama.cpp's Q8_0 activations: fastest at
            large batches, coarsest), ``bfloat16`` (AVX-512 BF16 dot products), ``float32``
            (the exact path: float32 activations, the dequantized weight's exact products),
            or ``auto`` (int16 where the CPU has AVX-512 VNNI, else bfloat16 where it has
            AVX-512 BF16, else float32). Dense weights and GPUs are unaffected.
        cpu_prefill_gemm: how the CPU runs a quantized matmul of many rows (prefill chunks
            of at least ``qgemm_pack.PREFILL_ROWS`` tokens, ``PREFILL_ROWS_AVX512_BF16`` for
            bfloat16 without AMX): ``bfloat16`` (dequantize the
            weight to bfloat16 once per call, then a bfloat16 GEMM: AMX tiles through
            oneDNN), ``float32`` (dequantize to float32 once per call, then a float32 GEMM:
            the exact dequantized product), ``kernel`` (the decode kernel of
            ``cpu_activation_dtype`` for every step), or ``auto`` (bfloat16 where the CPU has
            AMX-BF16 or, for int16/int8 activations, AVX-512 BF16; else float32 where the
            integer-dot kernel runs its AVX2 loop; kernel
            for the exact ``float32`` activations and elsewhere).
        max_logprobs: largest ``logprobs`` / ``top_logprobs`` a request may ask for
            (vLLM's ``--max-logprobs``); the request gate also caps it at the vocabulary size.
    """

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    quantization: str | None = None
    device: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    max_logprobs: int = 20
    cpu_activation_dtype: str = "auto"
    cpu_prefill_gemm: str = "auto"

    def __post_init__(self) -> None:
        _check(self.dtype in _DTYPES, "dtype", f"one of {_DTYPES}", self.dtype)
        _check(self.quantization in _QUANT, "quantization", f"one of {_QUANT}", self.quantization)
        _check(self.device in ("auto", "cpu", "cuda"), "device", "auto, cpu or cuda", self.device)
        _check(self.max_model_len is None or self.max_model_len >= 1,
               "max_model_len", ">= 1", self.max_model_len)
        _check(self.max_logprobs >= 0, "max_logprobs", ">= 0", self.max_logprobs)
        _check(self.cpu_activation_dtype in CPU_ACTIVATION_DTYPES, "cpu_activation_dtype",
               f"one of {CPU_ACTIVATION_DTYPES}", self.cpu_activation_dtype)
        _check(self.cpu_prefill_gemm in CPU_PREFILL_GEMMS, "cpu_prefill_gemm",
               f"one of {CPU_PREFILL_GEMMS}", self.cpu_prefill_gemm)

    def check_folders(self) -> None:
        """Check, cheaply, that the model (and tokenizer) folders exist.

        Raises:
            UnsupportedModelError: the model folder is missing or has no ``config.json``.
            ValueError: ``tokenizer`` is set but is not a folder.
        """
        check_model_dir(self.model)
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"tokenizer must be a local folder, got {self.tokenizer!r}")

    @property
    def tokenizer_folder(self) -> str:
        """Where the tokenizer files are (``tokenizer``, else the model folder, or the side
        folder of a GGUF file)."""
        return self.tokenizer or config_folder(self.model)

    @property
    def name(self) -> str:
        """The model name the API reports."""
        base = os.path.basename(os.path.normpath(self.model))
        return self.served_model_name or (base[:-len(".gguf")] if is_gguf(base) else base)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    Attributes:
        block_size: tokens per KV block (8, 16 or 32; default 16).
        num_gpu_blocks: number of KV blocks; overrides ``kv_cache_memory``.
        kv_cache_memory: KV cache budget in bytes, turned into blocks at start-up.
            Default when neither is set: 256 MiB (CPU), grown to one ``max_model_len``
            sequence within a quarter of RAM, or 90% of free GPU memory. A pool smaller than
            the model's context lowers ``max_model_len``; a user-set one must fit.
        enable_prefix_caching: reuse the KV of full blocks whose token prefix was computed
            before (automatic prefix caching, vLLM's ``--enable-prefix-caching``); on by
            default, as in vLLM V1 (its cost on a workload with no shared prefix is in
            ``benchmarks/prefix_caching_cost.py``).
        kv_cache_dtype: ``auto`` (the model's dtype, except a float32 quantized model on the
            CPU whose matmuls round activations, ``cpu_activation_dtype`` int16 / int8 /
            bfloat16: ``bfloat16`` there), ``bfloat16`` (two bytes per element whatever the
            model's dtype: half a float32 model's cache, rounded to nearest even on write),
            ``float32`` (four bytes: the exact cache, also on the CPU's rounding paths),
            ``int8`` or ``fp8_e4m3`` (one byte per element with per-head scales calibrated at
            start-up, so a budget holds about twice the tokens of a 16-bit cache); vLLM's
            ``--kv-cache-dtype``; see docs/kv-cache.md.
        gpu_memory_utilization: vLLM's ``--gpu-memory-utilization`` on a GPU: the fraction
            of the GPU's total memory the engine may hold, weights included; the pool gets
            what is left of it once the weights are loaded (``None``: 90% of the memory free
            after the weights). ``kv_cache_memory`` and ``num_gpu_blocks`` override it; the
            CPU ignores it (its pool is sized by ``kv_cache_memory``), with a warning.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        _check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        _check(self.block_size in (8, 16, 32), "block_size", "8, 16 or 32", self.block_size)
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
               "num_gpu_blocks", ">= 1", self.num_gpu_blocks)
        _check(self.kv_cache_memory is None or self.kv_cache_memory >= 1,
               "kv_cache_memory", ">= 1 byte", self.kv_cache_memory)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits.

    Attributes:
        max_num_seqs: most sequences in one step (the running-set cap).
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        enable_chunked_prefill: split prompts longer than the remaining budget across steps.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1",
               self.max_num_batched_tokens)


_COMPILATION_LEVELS = (0, 3)
MAX_CUDA_GRAPH_SIZE = 512


@dataclass(frozen=True)
class CompilationConfig:
    """How the model's forward runs (vLLM's flag names).

    Attributes:
        compilation_level: 0 (default): eager PyTorch. 3: ``torch.compile`` (inductor) of the
            dense segments between attentions (norms, projections, RoPE, MLP; vLLM's piecewise
            level), compiled on first use: tens of seconds of start-up on a CPU.
        enforce_eager: run every step op by op. Otherwise, on CUDA with the Triton
            attention backend, decode steps replay graphs captured at start-up for
            batch-size buckets (``cuda_graph_sizes``), and on the CPU a float32 model's decode
            steps of up to 32 sequences (every step of a small model) run as one fused C call
            (:mod:`nybble.models.cpu_fused`).
        cuda_graph_sizes: the buckets (sequences); default 1, 2, 4, then multiples of 8, up
            to ``max_num_seqs`` (at most 512). A decode step of B sequences runs the graph
            of the smallest bucket >= B, padded; larger steps run eagerly.
    """

    compilation_level: int = 0
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(self.compilation_level in _COMPILATION_LEVELS, "compilation_level",
               "0 (eager) or 3 (torch.compile of the dense segments)", self.compilation_level)
        sizes = self.cuda_graph_sizes
        _check(sizes is None or (len(sizes) > 0 and
                                 all(1 <= b <= MAX_CUDA_GRAPH_SIZE for b in sizes)),
               "cuda_graph_sizes", f"non-empty batch sizes in [1, {MAX_CUDA_GRAPH_SIZE}]", sizes)

_SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
              "prompt_lookup_min")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config`` keys).

    Attributes:
        method: ``ngram`` (proposals looked up in the sequence's own tokens, no model) or
            ``draft_model`` (a small model with the target's tokenizer proposes); default:
            ``draft_model`` when ``model`` is set, else ``ngram``.
        model: the draft model folder (``draft_model`` only).
        num_speculative_tokens: tokens proposed per sequence and step, ``k`` (1..16); the
            target verifies ``k + 1`` positions per sequence in one forward.
        prompt_lookup_max, prompt_lookup_min: ``ngram`` only: the longest and shortest
            suffix n-gram looked up (tokens; default 4 and 1).
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        _check(self.method in _SPEC_METHODS, "speculative_config.method",
               f"one of {_SPEC_METHODS}", self.method)
        k = self.num_speculative_tokens
        _check(isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
               "speculative_config.num_speculative_tokens",
               f"an int in [1, {MAX_SPECULATIVE_TOKENS}]", k)
        if self.method == "draft_model":
            _check(isinstance(self.model, str) and bool(self.model), "speculative_config.model",
                   "a draft model folder when method is 'draft_model'", self.model)
            _check(self.prompt_lookup_max is None and self.prompt_lookup_min is None,
                   "speculative_config.prompt_lookup_max/min", "unset with a draft model",
                   (self.prompt_lookup_max, self.prompt_lookup_min))
        else:
            _check(self.model is None, "speculative_config.model",
                   "unset when method is 'ngram'", self.model)
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                v = getattr(self, name)
                _check(v is None or (isinstance(v, int) and v >= 1),
                       f"speculative_config.{name}", "an int >= 1", v)
            _check(self.lookup_min <= self.lookup_max, "speculative_config.prompt_lookup_min",
                   f"<= prompt_lookup_max ({self.lookup_max})", self.lookup_min)

    @property
    def lookup_max(self) -> int:
        """The longest n-gram looked up (tokens)."""
        if self.prompt_lookup_max is not None:
            return self.prompt_lookup_max
        return max(4, self.prompt_lookup_min or 1)

    @property
    def lookup_min(self) -> int:
        """The shortest n-gram looked up (tokens)."""
        return self.prompt_lookup_min if self.prompt_lookup_min is not None else 1

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """Build from vLLM's JSON object (a dict, or its JSON text).

        Raises:
            ValueError: not a JSON object, an unknown key, or a value out of range.
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} "
                                 f"({e})") from None
        _check(isinstance(value, dict), "speculative_config", "a JSON object", value)
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        _check(not unknown, "speculative_config keys", f"among {_SPEC_KEYS}", unknown)
        args = dict(value)
        args.setdefault("method", "draft_model" if args.get("model") else "ngram")
        return cls(**args)

    def check_draft(self, target_model: str, target_tokenizer: str) -> None:
        """Check, cheaply, that the draft model can serve the target: a model folder whose
        vocabulary size and tokenizer files equal the target's (speculative decoding compares
        token ids, so both models must speak the same ones). No-op for ``ngram``.

        Raises:
            UnsupportedModelError: the draft folder is missing or has no ``config.json``.
            ValueError: the vocabulary sizes or the tokenizer files differ.
        """
        if self.model is None:
            return
        check_model_dir(self.model)
        vocab = [(read_json(os.path.join(d, "config.json"), lenient=True) or {})
                 .get("vocab_size") for d in (self.model, target_model)]
        _check(vocab[0] == vocab[1], "the draft model's vocab_size",
               f"the target's ({vocab[1]})", vocab[0])
        for name in TOKENIZER_FILES:
            files = [os.path.join(self.model, name), os.path.join(target_tokenizer, name)]
            if os.path.isfile(files[1]) and file_bytes(files[0]) != file_bytes(files[1]):
                raise ValueError(f"the draft model's {name} must equal the target's "
                                 f"({files[1]}): draft and target must share one tokenizer, "
                                 f"got a different or missing {files[0]}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
"""Allowed ``distributed_executor_backend`` values (vLLM's names)."""


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (vLLM's flag names; docs/distributed.md).

    Attributes:
        tensor_parallel_size: ranks the model is split over (Megatron-style: heads and MLP
            columns/rows, vocabulary); 1: no split.
        distributed_executor_backend: ``mp`` (worker processes nybble starts on this
            machine) or ``ray`` (Ray actors placed by a placement group; ``RAY_ADDRESS``
            names an existing cluster, else a local one is started).
        distributed_timeout_s: seconds a collective (or the start-up rendezvous) waits for
            the other ranks before it raises (seconds; no hang when a worker dies).
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    distributed_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1",
               self.tensor_parallel_size)
        _check(self.distributed_executor_backend in DISTRIBUTED_EXECUTOR_BACKENDS,
               "distributed_executor_backend", f"one of {DISTRIBUTED_EXECUTOR_BACKENDS}",
               self.distributed_executor_backend)
        _check(self.distributed_timeout_s > 0, "distributed_timeout_s", "> 0 seconds",
               self.distributed_timeout_s)


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values allowed (vLLM's list)."""


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flag names; docs/lora.md).

    Attributes:
        enable_lora: serve LoRA adapters on top of the base model.
        max_loras: device slots: the most distinct adapters in one step (a request whose
            adapter finds every slot used by running requests waits).
        max_lora_rank: the largest adapter rank served (slots are zero-padded to it).
        max_cpu_loras: adapters kept loaded on the host (an LRU cache that fills the slots);
            ``None``: ``max_loras``.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_loras, int) and self.max_loras >= 1, "max_loras",
               "an int >= 1", self.max_loras)
        _check(self.max_lora_rank in MAX_LORA_RANKS, "max_lora_rank",
               f"one of {MAX_LORA_RANKS}", self.max_lora_rank)
        _check(self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int) and
                                              self.max_cpu_loras >= self.max_loras),
               "max_cpu_loras", f">= max_loras ({self.max_loras})", self.max_cpu_loras)

    @property
    def cpu_loras(self) -> int:
        """Adapters the host cache holds."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built once (``EngineConfig.from_kwargs``).

    Attributes:
        model_config, cache_config, scheduler_config, compilation_config,
            parallel_config: the parts.
        attention_backend: ``auto`` (Triton on CUDA, ``cpu`` on the CPU), ``cpu`` (the Cython
            paged decode kernel, torch for prefill), ``torch`` (the pure-torch reference) or
            ``triton``.
        disable_log_stats: do not log the periodic stats line.
        speculative_config: speculative decoding, or ``None`` (off); ``from_kwargs`` takes
            vLLM's dict (or its JSON text).
        threads: torch intra-op threads of the process that runs the model; ``None``: the
            default of :func:`nybble.threads.resolve_threads`.
        lora_config: multi-LoRA serving (:class:`LoRAConfig`; off by default).
    """

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    attention_backend: str = "auto"
    disable_log_stats: bool = False
    threads: int | None = None
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _check(self.attention_backend in _ATTN_BACKENDS, "attention_backend",
               f"one of {_ATTN_BACKENDS}", self.attention_backend)
        _check(self.threads is None or self.threads >= 1, "threads", ">= 1", self.threads)
        if self.parallel_config.tensor_parallel_size > 1:
            # NOTE: these run the model outside the step that the workers follow
            for name, value, allowed in (
                    ("speculative_config", self.speculative_config, None),
                    ("kv_cache_dtype", self.cache_config.kv_cache_dtype, "auto"),
                    ("compilation_level", self.compilation_config.compilation_level, 0)):
                _check(value == allowed, f"{name} with tensor_parallel_size > 1", repr(allowed),
                       value)
        if self.lora_config.enable_lora:
            # NOTE: a LoRA step reads per-row adapter slots that these paths do not carry
            for name, value, allowed in (
                    ("speculative_config", self.speculative_config, None),
                    ("compilation_level", self.compilation_config.compilation_level, 0)):
                _check(value == allowed, f"{name} with enable_lora", repr(allowed), value)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Build from flat vLLM-style keyword arguments (``max_num_seqs=...``, ``dtype=...``).

        Raises:
            TypeError: an argument that no part of the config knows.
            ValueError: a value outside its range.
        """
        parts: dict[type, dict[str, Any]] = {ModelConfig: {}, CacheConfig: {},
                                             SchedulerConfig: {}, CompilationConfig: {},
                                             ParallelConfig: {}, LoRAConfig: {}, cls: {}}
        if model is not None:
            parts[ModelConfig]["model"] = model
        for key, value in kwargs.items():
            for part in parts:
                if key in {f.name for f in fields(part)}:
                    parts[part][key] = value
                    break
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        spec = parts[cls].get("speculative_config")
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            parts[cls]["speculative_config"] = SpeculativeConfig.from_dict(spec)
        return cls(model_config=ModelConfig(**parts[ModelConfig]),
                   cache_config=CacheConfig(**parts[CacheConfig]),
                   scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
                   compilation_config=CompilationConfig(**parts[CompilationConfig]),
                   parallel_config=ParallelConfig(**parts[ParallelConfig]),
                   lora_config=LoRAConfig(**parts[LoRAConfig]),
                   **parts[cls])


def encode_config(config: EngineConfig) -> str:
    """``config`` as JSON text (passed to the engine-core process and to tensor-parallel
    workers on their command lines)."""
    import msgspec  # NOTE: lazily, so `import nybble` does not load it

    return msgspec.json.encode(config).decode()


def decode_config(text: str) -> EngineConfig:
    """The :class:`EngineConfig` of :func:`encode_config` (validated again on the way in).

    Raises:
        msgspec.ValidationError: a field out of its range.
    """
    import msgspec

    return msgspec.json.decode(text, type=EngineConfig)
