"""Load a Hugging Face model folder (safetensors only) into :class:`LlamaForCausalLM`.

Weights stream tensor by tensor from the checkpoint's files only
(:func:`nybble.model_files.model_weight_files`: ``model.safetensors``, sharded
``model-xxxxx-of-yyyyy.safetensors`` + ``model.safetensors.index.json``, or AutoGPTQ's
``gptq_model-4bit-128g.safetensors``), never from another ``*.safetensors`` in the folder.
Pickle checkpoints (``*.bin``, ``*.pt``) are refused: they can run arbitrary code.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from nybble.config import ModelConfig
from nybble.model_files import check_model_dir, config_folder, is_gguf, model_weight_files
from nybble.distributed.comm import TPGroup, single_rank
from nybble.errors import UnsupportedModelError
from nybble.kernels.cpu.qgemm import have_bf16, have_vnni, idot_fast_path
from nybble.kernels.cpu.qgemm_pack import PREFILL_ROWS, PREFILL_ROWS_AVX512_BF16, has_amx_bf16
from nybble.kernels.interface import AttentionBackend
from nybble.models.hf_config import HFConfig, load_hf_config
from nybble.models.linear import dense_linear_factory
from nybble.models.llama import LlamaForCausalLM
from nybble.models.quant_head import quantized_head
from nybble.models.registry import arch_spec
from nybble.models.shape import ModelShape
from nybble.models.tp_layout import TPLayout
from nybble.models.tp_shard import G_IDX_NAMES, is_act_order, read_shard, read_vocab_rows
from nybble.quant.config import load_quant_config
from nybble.quant.linear import CpuPathLog

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, and the facts derived while loading it.

    Attributes:
        model: the module, in eval mode, on ``device``.
        hf_config: the checkpoint's config (``config.json`` with transformers' defaults).
        shape: the model's dimensions (layers, heads, KV heads, head_dim, vocabulary).
        dtype: activation/weight dtype of non-quantized parts.
        max_model_len: longest sequence the engine allows (tokens).
        eos_token_ids: stop ids from generation_config.json and config.json.
        quant_description: one line describing the quantization, or ``"none"``.
        weight_bytes: bytes of all parameters and buffers (RoPE tables excluded).
        linear_weight_bytes: bytes of the linear layers' weights alone.
        cpu_activations: on the CPU, what the quantized matmuls turn activations into
            (``int16`` / ``int8`` / ``bfloat16``, or ``float32``: the exact path); None for a
            model without quantized layers or on a GPU.
    """

    model: LlamaForCausalLM
    hf_config: HFConfig
    shape: ModelShape
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    quant_description: str
    weight_bytes: int
    linear_weight_bytes: int
    cpu_activations: str | None = None

    @property
    def kv_free_window(self) -> int | None:
        """The sliding window (tokens) out of which KV blocks may be freed: the largest
        layer window when *every* attention layer has one (Mistral, Phi-3 with
        ``sliding_window``), else None (a full-attention layer, as in Gemma 2/3's global
        layers, still reads every position). A window that covers every position the engine
        allows counts as none (the layers drop it)."""
        windows = [layer.self_attn.window for layer in self.model.layers]
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    @property
    def shard_shape(self) -> ModelShape:
        """The dimensions of this rank's shard: ``shape`` with this rank's query and KV
        heads (tensor parallelism; ``shape`` itself on one rank). The KV cache is sized by
        it."""
        layout = self.model.layout
        return dataclasses.replace(self.shape, num_heads=layout.num_heads,
                                   num_kv_heads=layout.num_kv_heads)


def resolve_dtype(name: str, hf_config: HFConfig, device: torch.device) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype on GPU (float32 becomes float16), float32 on CPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = _DTYPES.get(str(ckpt).replace("torch.", ""), torch.float16)
    return torch.float16 if ckpt == torch.float32 else ckpt


def eos_token_ids(model_dir: str, hf_config: HFConfig) -> tuple[int, ...]:
    """Stop ids as transformers and vLLM read them: generation_config.json, then config.json.

    ``eos_token_id`` may be an int or a list in either file (stories260k's generation config
    says ``[2, 1]``: the model ends a story with BOS).
    """
    ids: list[int] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    sources: list[Any] = []
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    for value in sources:
        for i in (value if isinstance(value, list) else [value]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _module_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters()) + [b for n, b in module.named_buffers()
                                           if not n.endswith(("cos", "sin"))]
    return sum(t.numel() * t.element_size() for t in tensors)


def cpu_activations(choice: str) -> str:
    """``ModelConfig.cpu_activation_dtype`` resolved: ``auto`` is ``int16`` where the CPU has
    AVX-512 VNNI (the integer-dot kernel's instruction), else ``bfloat16`` where it has
    AVX-512 BF16, else ``float32``. Measured on SmolLM2-135M (benchmarks/README.md): with VNNI
    int16 is both the faster (about 2x bf16's matmul speed at one row) and the finer of the
    two. On AVX2 alone (no VNNI) int16 is opt-in: its 4-bit loop decodes one sequence
    ~1.2-1.4x faster than the exact float32 kernel but 16-64 sequences ~10% slower, and its
    8-bit loop (each byte split into two nibbles) is slower at every batch size, so the exact
    path stays the default there."""
    if choice == "auto":
        return "int16" if have_vnni() else "bfloat16" if have_bf16() else "float32"
    return choice


def cpu_prefill_gemm(choice: str, activations: str) -> str | None:
    """``ModelConfig.cpu_prefill_gemm`` resolved to the GEMM of many-row quantized matmuls
    (``CpuPathLog.prefill_dtype``: ``bfloat16`` / ``float32``), or None (the decode kernel for
    every step). ``auto``: none for the exact ``float32`` activations (their own path is
    already a float32 GEMM beyond 256 rows); ``bfloat16`` where the CPU has AMX-BF16 (measured
    on SmolLM2-135M: 1,450-token prefill ~2.5x faster, +0.13% held-out perplexity), and for
    the integer-dot activations where it has AVX-512 BF16 without AMX (~1.6x faster at 1,450
    tokens, from :data:`~nybble.kernels.cpu.qgemm_pack.PREFILL_ROWS_AVX512_BF16` rows);
    ``float32`` where the integer-dot kernel runs its AVX2 loop (prefill ~1.4x faster, exact);
    else none."""
    if choice == "kernel" or (choice == "auto" and activations == "float32"):
        return None
    if choice != "auto":
        return choice
    if has_amx_bf16():
        return "bfloat16"
    if activations in ("int16", "int8") and have_bf16():
        return "bfloat16"
    if activations in ("int16", "int8") and idot_fast_path() == "AVX2":
        return "float32"
    return None


def cpu_prefill_rows(choice: str, activations: str) -> int | None:
    """Rows from which a packed quantized matmul takes :func:`cpu_prefill_gemm`'s GEMM
    (``CpuPathLog.prefill_rows``), or None (never): ``PREFILL_ROWS_AVX512_BF16`` for the
    bfloat16 GEMM on a CPU without AMX, else ``PREFILL_ROWS`` (both measured, in
    :mod:`nybble.kernels.cpu.qgemm_pack`)."""
    dtype = cpu_prefill_gemm(choice, activations)
    if dtype is None:
        return None
    if dtype == "bfloat16" and not has_amx_bf16():
        return PREFILL_ROWS_AVX512_BF16
    return PREFILL_ROWS


def _cpu_activations(model: torch.nn.Module, device: torch.device) -> str | None:
    """The resolved ``cpu_activation_dtype`` of a model with quantized layers on the CPU (the
    path log its quantized modules share), else None (a GPU, or no quantized layer: a dense
    model, an F32 / F16 GGUF)."""
    log = next((m.path_log for m in model.modules() if hasattr(m, "path_log")), None)
    return log.activations if log is not None and device.type == "cpu" else None


def _set_activations(log: CpuPathLog, choice: str) -> None:
    """Set ``log.activations`` from ``--cpu-activation-dtype``."""
    log.activations = cpu_activations(choice)


def _set_prefill(log: CpuPathLog, choice: str) -> None:
    """Set ``log.prefill_rows`` / ``log.prefill_dtype`` from ``--cpu-prefill-gemm``."""
    dtype = cpu_prefill_gemm(choice, log.activations)
    log.prefill_rows = cpu_prefill_rows(choice, log.activations)
    log.prefill_dtype = dtype or "bfloat16"


def load_model(cfg: ModelConfig, backend: AttentionBackend, device: torch.device,
               tp: TPGroup | None = None) -> LoadedModel:
    """Build the model for ``cfg.model`` and load its weights (under tensor parallelism
    ``tp``: this rank's shard, read as slices of the checkpoint tensors).

    Raises:
        UnsupportedModelError: unknown architecture, pickle-only weights, unsupported
            quantization, a checkpoint tensor whose shape does not fit, or a layer that
            cannot be split over ``tp`` (the message names the layer and sizes).
        ValueError: ``max_model_len`` larger than the model's position limit.
    """
    check_model_dir(cfg.model)
    folder = config_folder(cfg.model)
    hf_config = load_hf_config(folder)
    raw_config = hf_config.to_dict()
    spec = arch_spec(hf_config)
    gguf = None
    if is_gguf(cfg.model):
        from nybble.models.gguf_model import open_gguf

        gguf = open_gguf(cfg, tp)
        _set_activations(gguf.path_log, cfg.cpu_activation_dtype)
        _set_prefill(gguf.path_log, cfg.cpu_prefill_gemm)
        quant = None
    else:
        if cfg.quantization == "gguf":
            raise UnsupportedModelError(f"quantization 'gguf' needs a .gguf model file, got "
                                        f"{cfg.model!r}")
        quant = load_quant_config(cfg.model, raw_config, cfg.quantization)
        if quant is not None:
            _set_activations(quant.path_log, cfg.cpu_activation_dtype)
            _set_prefill(quant.path_log, cfg.cpu_prefill_gemm)
    dtype = resolve_dtype(cfg.dtype, hf_config, device)
    # NOTE: the model's own limit; sliding-window layers attend inside their window
    limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    max_len = cfg.max_model_len or limit
    if max_len > limit:
        raise ValueError(f"max_model_len must be <= {limit} (the model's position limit), "
                         f"got {max_len}")
    factory = (gguf.factory if gguf is not None else
               quant.linear_factory if quant is not None else dense_linear_factory)
    shape = ModelShape.from_hf_config(hf_config)
    layout = TPLayout.of(shape, int(hf_config.intermediate_size), tp or single_rank(),
                         spec.moe.intermediate_size if spec.moe is not None else None)
    try:
        model = LlamaForCausalLM(hf_config, factory, backend, max_len, dtype, device, spec,
                                 layout)
    except UnsupportedModelError as e:
        if not layout.sharded:
            raise
        n = layout.tp.world_size
        raise UnsupportedModelError(
            f"{e} (under tensor_parallel_size {n} each rank holds 1/{n} of the heads and of "
            f"intermediate_size; a tensor_parallel_size whose shares fit is allowed)") from e
    if gguf is not None:
        gguf.load(model, dtype)
    else:
        files = model_weight_files(cfg.model)
        head = quantized_head(quant, files, shape.hidden_size, shape.vocab_size, dtype, device,
                              layout.sharded)
        if head is not None:
            model.lm_head = None   # the quantized module replaces the float matrix
        _load_weights(model, files, dtype, skip_head=head is not None)
        if head is not None:
            model.set_quantized_vocab(None, head)
    model.eval()
    # the projections, and each MoE block whole (router and experts; none of its parts is a
    # "_proj")
    linear_bytes = sum(_module_bytes(m) for n, m in model.named_modules()
                       if n.endswith(("_proj",)) or hasattr(m, "expert_prefixes"))
    return LoadedModel(model=model, hf_config=hf_config, shape=model.shape, dtype=dtype,
                       max_model_len=max_len,
                       eos_token_ids=eos_token_ids(folder, hf_config),
                       quant_description=(gguf.describe() if gguf is not None else
                                          quant.describe() if quant is not None else "none"),
                       weight_bytes=_module_bytes(model), linear_weight_bytes=linear_bytes,
                       cpu_activations=_cpu_activations(model, device))


def _fused_targets(model: LlamaForCausalLM) -> dict[str, tuple[str, int]]:
    """Checkpoint module prefix -> (model module name, shard index)."""
    targets: dict[str, tuple[str, int]] = {}
    for name, module in model.named_modules():
        prefixes = getattr(module, "shard_prefixes", None)
        if prefixes:
            for i, p in enumerate(prefixes):
                targets[p] = (name, i)
    return targets


def _load_weights(model: LlamaForCausalLM, files: list[str], dtype: torch.dtype,
                  skip_head: bool = False) -> None:
    """Stream every checkpoint tensor into ``model`` (fused shards concatenated); with
    ``skip_head``, the ``lm_head.*`` tensors are left to :func:`quantized_head`."""
    shards: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    targets = _fused_targets(model)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    layout = model.layout
    act_order = _row_parallel_act_order(model, files, targets) if layout.sharded else set()
    experts = _expert_targets(model)
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if "rotary_emb" in key or (skip_head and key.startswith("lm_head.")):
                    continue
                module_prefix, _, suffix = key.rpartition(".")
                if module_prefix in experts:    # one projection of a stacked MoE expert
                    name, expert, part = experts[module_prefix]
                    modules[name].load_expert(expert, part, suffix, f.get_slice(key))
                    continue
                if module_prefix in targets:
                    name, idx = targets[module_prefix]
                    slices = getattr(modules[name], "tp_slices", None)
                    shards.setdefault(name, {}).setdefault(idx, {})[suffix] = read_shard(
                        f, key, suffix, modules[name], slices[idx] if slices else None,
                        layout.tp.rank, name in act_order)
                    continue
                target = key.removeprefix("model.") if key != "lm_head.weight" else "lm_head"
                if target not in params:
                    logger.warning("ignoring checkpoint tensor %s (no such parameter)", key)
                    continue
                if layout.sharded and target in ("embed_tokens.weight", "lm_head"):
                    tensor = read_vocab_rows(f, key, layout.vocab_start, layout.vocab_rows)
                else:
                    tensor = f.get_tensor(key)
                if tensor.shape != params[target].shape:
                    raise UnsupportedModelError(
                        f"{key} must have shape {tuple(params[target].shape)}, got "
                        f"{tuple(tensor.shape)}")
                params[target].data.copy_(tensor.to(dtype))
                loaded.add(target)
    for name, by_shard in shards.items():
        module = modules[name]
        if len(by_shard) != len(module.shard_prefixes):
            raise UnsupportedModelError(f"checkpoint has {len(by_shard)} of the "
                                        f"{len(module.shard_prefixes)} shards of {name}")
        module.load_tensors(_concat_shards(module, [by_shard[i] for i in sorted(by_shard)]))
    fused = [n for n, m in modules.items() if getattr(m, "shard_prefixes", None)
             or getattr(m, "expert_prefixes", None)]
    missing = sorted(n for n in params if n not in loaded and
                     not any(n.startswith(m + ".") for m in fused))
    missing += sorted(n for n in fused if n not in shards and
                      not getattr(modules[n], "expert_prefixes", None))
    missing += sorted(p for n in fused if getattr(modules[n], "expert_prefixes", None)
                      for p in modules[n].missing_experts())
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks tensors for {missing[:5]}"
                                    f"{' ...' if len(missing) > 5 else ''}")


def _expert_targets(model: LlamaForCausalLM) -> dict[str, tuple[str, int, int]]:
    """Checkpoint module prefix of a stacked MoE expert's projection -> (model module name,
    expert, part) (:attr:`nybble.models.moe.MoEBlock.expert_prefixes`)."""
    return {prefix: (name, expert, part) for name, module in model.named_modules()
            for prefix, (expert, part) in (getattr(module, "expert_prefixes", None)
                                           or {}).items()}


def _row_parallel_act_order(model: LlamaForCausalLM, files: list[str],
                            targets: dict[str, tuple[str, int]]) -> set[str]:
    """Row-parallel quantized layers whose ``g_idx`` is not contiguous (act order): their
    shards keep every group (:meth:`~nybble.quant.linear.QuantLinear.keep_all_groups`)."""
    modules = dict(model.named_modules())
    found: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            for key in keys:
                prefix, _, suffix = key.rpartition(".")
                name = targets.get(prefix, (None, 0))[0]
                module = modules.get(name) if name else None
                slices = getattr(module, "tp_slices", None)
                if suffix not in G_IDX_NAMES or not slices or slices[0].axis != "in":
                    continue
                group_key = f"{prefix}.{module.group_tensors[0]}"
                if group_key not in keys:
                    raise UnsupportedModelError(f"{group_key} must be in the file of {key} to "
                                                f"split an act-order layer, got {path}")
                dim = module.input_dims[module.group_tensors[0]]
                groups = f.get_slice(group_key).get_shape()[dim]
                if is_act_order(f.get_tensor(key), groups):
                    module.keep_all_groups(groups)
                    found.add(name)
    return found


def _concat_shards(module: torch.nn.Module,
                   shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate each tensor name along ``module.output_dims[name]`` (None: shared)."""
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards if name in s]
        if len(parts) != len(shards):
            raise UnsupportedModelError(f"tensor {name!r} is present in only some shards of "
                                        f"{module.shard_prefixes}")
        dim = module.output_dims.get(name, 0)
        if dim is None or len(parts) == 1:
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                raise UnsupportedModelError(f"shared tensor {name!r} differs between the shards "
                                            f"of {module.shard_prefixes}")
            out[name] = parts[0]
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out
