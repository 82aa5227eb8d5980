"""The rules of a PEFT LoRA adapter folder, checked without torch (the API process checks an
adapter before it is loaded, the engine core again when it loads the weights).

A folder as ``PeftModel.save_pretrained`` writes it: ``adapter_config.json`` (``peft_type``
``LORA``, ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``,
``target_modules``...) and ``adapter_model.safetensors`` with, per adapted projection,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``. nybble serves LoRA on the attention and MLP projections
(``q/k/v/o_proj``, ``gate/up/down_proj``) with the scale ``lora_alpha / r`` (Hu et al. 2021)
or, with ``use_rslora``, ``lora_alpha / sqrt(r)`` (rsLoRA, Kalajdzievski 2023), per module when
``rank_pattern`` / ``alpha_pattern`` say so (PEFT's rule: the first pattern ``p`` for which
the module's name matches ``(.*\\.)?(p)$``).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from nybble.errors import LoRAAdapterError
from nybble.model_files import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES
"""The projections nybble adapts, in the order of the fused projections' shards."""
_ALLOWED = ", ".join(LORA_MODULES)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_([AB])\.weight$")
_PARENT = {name: "self_attn" for name in ATTENTION_MODULES} | \
    {name: "mlp" for name in MLP_MODULES}


@dataclass(frozen=True, slots=True)
class BaseTargets:
    """What an adapter may adapt on this base: ``num_layers`` decoder layers, and the
    ``(in_features, out_features)`` of each projection name of :data:`LORA_MODULES`."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, num_layers: int, hidden: int, num_heads: int, num_kv_heads: int,
           head_dim: int, intermediate: int) -> BaseTargets:
        """The projections of a Llama-family decoder of these sizes."""
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        return cls(num_layers, {"q_proj": (hidden, q), "k_proj": (hidden, kv),
                                "v_proj": (hidden, kv), "o_proj": (q, hidden),
                                "gate_proj": (hidden, intermediate),
                                "up_proj": (hidden, intermediate),
                                "down_proj": (intermediate, hidden)})


@dataclass(frozen=True, slots=True)
class AdapterModule:
    """One adapted projection: ``layer``, ``name`` (of :data:`LORA_MODULES`), its ``rank``,
    its ``scale`` (``alpha / r`` or ``alpha / sqrt(r)``), and the tensor names of its
    ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` in the weights file."""

    layer: int
    name: str
    rank: int
    scale: float
    a_key: str
    b_key: str


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter folder: its weights file, its modules, its largest rank."""

    path: str
    weights_file: str
    modules: tuple[AdapterModule, ...]
    max_rank: int


def _fail(path: str, message: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {path}: {message}", param="lora_path")


def _pattern_value(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` rule: the value of the first pattern ``p``
    for which ``module_key`` matches ``(.*\\.)?(p)$``, else ``default``."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return value
    return default


def safetensors_header(file: str) -> dict[str, dict[str, Any]]:
    """The tensor table of a safetensors file (name -> ``{"dtype", "shape",
    "data_offsets"}``), read from its JSON header.

    Raises:
        ValueError: not a safetensors file.
        OSError: the file cannot be read.
    """
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000 or size > os.path.getsize(file):
            raise ValueError("its header length is not that of a safetensors file")
        table = json.loads(f.read(size))
    if not isinstance(table, dict):
        raise ValueError("its header is not a JSON object")
    table.pop("__metadata__", None)
    return table


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise _fail(path, "no such folder (lora_path must be a PEFT adapter folder holding "
                          f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        config = read_json(os.path.join(path, ADAPTER_CONFIG))
    except (OSError, ValueError) as e:
        raise _fail(path, f"{ADAPTER_CONFIG} is not a readable JSON file ({e})") from e
    if config is None:
        raise _fail(path, f"no {ADAPTER_CONFIG} object in the folder (a PEFT adapter folder "
                          f"holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    return config


def _check_config(path: str, config: dict[str, Any]) -> None:
    """Refuse what nybble does not run, each with what is allowed."""
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise _fail(path, f"peft_type must be LORA, got {kind!r}")
    if config.get("use_dora"):
        raise _fail(path, "use_dora is true: DoRA adapters are not supported (only plain LoRA "
                          "and rsLoRA)")
    if config.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {config['modules_to_save']!r} is set: an adapter "
                          f"may only add LoRA weights to {_ALLOWED}, not replace whole modules")
    if config.get("fan_in_fan_out"):
        raise _fail(path, "fan_in_fan_out is true (Conv1D weights); Llama-family projections "
                          "need it false")
    if config.get("bias", "none") not in ("none", None) or config.get("lora_bias"):
        raise _fail(path, f"bias must be 'none' and lora_bias false, got bias "
                          f"{config.get('bias')!r}, lora_bias {config.get('lora_bias')!r}")
    for variant in ("use_qalora", "use_bdlora"):
        if config.get(variant):
            raise _fail(path, f"{variant} is true: only plain LoRA and rsLoRA adapters are "
                              f"supported")
    if config.get("target_parameters"):
        raise _fail(path, f"target_parameters is not supported; target_modules may name "
                          f"{_ALLOWED}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        vocab = [t for t in targets if t in ("embed_tokens", "lm_head")]
        if vocab:
            raise _fail(path, f"target_modules names {', '.join(vocab)}: adapters on the "
                              f"embeddings or the LM head are not supported; allowed: "
                              f"{_ALLOWED}")
        other = [t for t in targets if t.rsplit(".", 1)[-1] not in LORA_MODULES]
        if other:
            raise _fail(path, f"target_modules names {', '.join(map(str, other))}, which this "
                              f"base does not have; allowed: {_ALLOWED}")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise _fail(path, f"{field} must be a positive number, got {value!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(field) or {}, dict):
            raise _fail(path, f"{field} must be an object (pattern -> value)")


def _pair_tensors(path: str, table: dict[str, dict[str, Any]]
                  ) -> dict[tuple[int, str], dict[str, str]]:
    """``(layer, name) -> {"A": key, "B": key}``; refuses any tensor that is not a LoRA A/B
    of an allowed projection."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in table:
        if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
            raise _fail(path, f"tensor {key}: adapters on the embeddings or the LM head are not "
                              f"supported; allowed: {_ALLOWED}")
        if "lora_magnitude_vector" in key:
            raise _fail(path, f"tensor {key}: DoRA adapters are not supported")
        m = _KEY.match(key)
        if m is None:
            raise _fail(path, f"tensor {key} is not the lora_A/lora_B weight of a decoder "
                              f"projection; allowed projections: {_ALLOWED}")
        layer, parent, name, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if _PARENT.get(name) != parent:
            raise _fail(path, f"tensor {key} adapts {parent}.{name}, which this base does not "
                              f"have; allowed: {_ALLOWED}")
        pairs.setdefault((layer, name), {})[which] = key
    return pairs


def read_adapter(path: str, base: BaseTargets, max_rank: int) -> AdapterSpec:
    """Check a PEFT LoRA folder against a base and the engine's largest rank.

    Args:
        path: the adapter folder.
        base: what the served base model may adapt (:meth:`BaseTargets.of`).
        max_rank: the engine's ``max_lora_rank``.

    Returns:
        The :class:`AdapterSpec`: every adapted projection with its rank and scale.

    Raises:
        LoRAAdapterError: a folder that is not a LoRA adapter, DoRA, adapters on the
            embeddings / LM head / ``modules_to_save``, a projection or layer the base lacks,
            tensor shapes of another base, a rank above ``max_rank``, or ranks that disagree
            with ``r`` / ``rank_pattern``.
    """
    config = _read_config(path)
    _check_config(path, config)
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise _fail(path, f"no {ADAPTER_WEIGHTS} (nybble reads adapters saved with "
                          f"safe_serialization, PEFT's default)")
    try:
        table = safetensors_header(weights)
    except (OSError, ValueError) as e:
        raise _fail(path, f"{ADAPTER_WEIGHTS} cannot be read: {e}") from e
    pairs = _pair_tensors(path, table)
    if not pairs:
        raise _fail(path, f"{ADAPTER_WEIGHTS} holds no lora_A/lora_B weights")
    r, alpha = config["r"], config["lora_alpha"]
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = []
    for (layer, name), pair in sorted(pairs.items()):
        where = f"model.layers.{layer}.{_PARENT[name]}.{name}"
        if layer >= base.num_layers:
            raise _fail(path, f"it adapts {where}, but the base has {base.num_layers} layers")
        if set(pair) != {"A", "B"}:
            raise _fail(path, f"{where} has lora_{''.join(pair)} without its other half")
        a_shape, b_shape = table[pair["A"]].get("shape"), table[pair["B"]].get("shape")
        width, out = base.shapes[name]
        rank = a_shape[0] if a_shape and len(a_shape) == 2 else -1
        if a_shape != [rank, width] or b_shape != [out, rank]:
            raise _fail(path, f"{where}: lora_A {a_shape} and lora_B {b_shape} do not fit this "
                              f"base's projection [{out}, {width}] (lora_A must be [r, {width}], "
                              f"lora_B [{out}, r]): an adapter of another base model")
        if rank > max_rank:
            raise _fail(path, f"{where} has rank {rank}, above max_lora_rank {max_rank} (raise "
                              f"--max-lora-rank to at least {rank})")
        module_key = f"model.layers.{layer}.{_PARENT[name]}.{name}"
        want = _pattern_value(ranks, module_key, r)
        if want != rank:
            raise _fail(path, f"{where} has rank {rank}, but r / rank_pattern say {want}")
        a = _pattern_value(alphas, module_key, alpha)
        scale = a / math.sqrt(rank) if config.get("use_rslora") else a / rank
        modules.append(AdapterModule(layer, name, rank, float(scale), pair["A"], pair["B"]))
    return AdapterSpec(path, weights, tuple(modules), max(m.rank for m in modules))
