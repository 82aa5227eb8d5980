"""Multi-LoRA on the decoder: the device slots of stacked adapter weights, and the projections
that add each token row's adapter to the base output.

:class:`LoRASlots` holds, per decoder layer and fused projection, the stacked tensors
:func:`nybble.kernels.lora.add_lora` reads (``lora_a [S, R', in]``, ``lora_b [S, out, R']``,
the adapter's scale folded into ``lora_b``). A fused projection is one LoRA of its shards'
ranks side by side: qkv's ``lora_a`` stacks the q, k and v ``A`` rows (``R' = 3 R``) and its
``lora_b`` is block-diagonal (q's ``B`` in the q output rows and q's rank columns, and so on),
so one shrink and one expand serve all three; gate/up likewise (``R' = 2 R``). The adapter
works on the output of whatever linear the base uses (dense, GPTQ/AWQ, GGUF): the update is
added after it.

Each step the runner calls :meth:`LoRASlots.set_step` with the slot of every token row
(``[T]`` int64, ``-1`` = base), or ``None`` when no row of the step uses an adapter (then
nothing extra runs); the rows are prepared once (:class:`~nybble.kernels.lora.LoRARows`) for
every projection of the step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from safetensors import safe_open

from nybble.errors import LoRAAdapterError
from nybble.kernels.lora import LoRARows, add_lora
from nybble.lora_files import LORA_MODULES, AdapterSpec, BaseTargets
from nybble.models.layer_ops import Fn
from nybble.models.tp_layout import ShardSlice, TPLayout

_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
"""LayerOps field -> the projection names of its shards, in output order."""


def shard_slices(layout: TPLayout) -> dict[str, ShardSlice]:
    """The part of each adapted projection this rank holds (:class:`TPLayout`): q/k/v and
    gate/up are column-parallel (a range of output features, so of ``B``'s rows), o/down
    row-parallel (a range of input features, so of ``A``'s columns)."""
    return {"q_proj": layout.q, "k_proj": layout.kv, "v_proj": layout.kv,
            "o_proj": layout.o_in, "gate_proj": layout.inter, "up_proj": layout.inter,
            "down_proj": layout.down_in}


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A loaded adapter, on the host: ``(layer, name) -> (A [r, in], scale * B [out, r])`` in
    the model dtype, plus its :class:`AdapterSpec`."""

    spec: AdapterSpec
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype) -> AdapterWeights:
    """Read the ``lora_A`` / ``lora_B`` tensors of a checked adapter (:func:`nybble.lora_files.
    read_adapter`) in float32, fold each module's scale into ``B`` and cast to ``dtype``.

    Raises:
        LoRAAdapterError: the weights file cannot be read.
    """
    tensors = {}
    try:
        with safe_open(spec.weights_file, framework="pt") as f:
            for m in spec.modules:
                a = f.get_tensor(m.a_key).float()
                b = f.get_tensor(m.b_key).float() * m.scale
                tensors[(m.layer, m.name)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    except (OSError, RuntimeError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {spec.path}: its weights cannot be read ({e})",
                               param="lora_path") from e
    return AdapterWeights(spec, tensors)


class LoRASlots:
    """``max_loras`` device slots of stacked adapter weights for every decoder layer.

    Under tensor parallelism each rank holds its base layer's share of every adapter
    (Megatron-LM's split applied to ``A`` and ``B``): a column-parallel projection (q/k/v,
    gate/up) keeps all of ``A`` and the rows of ``B`` of its output features; a row-parallel
    one (o, down) keeps the columns of ``A`` of its input features and all of ``B``, so its
    update ``B (A_r x_r)`` is a partial sum like the base output's, and the layer's one
    all-reduce adds both (the update must be added before that all-reduce:
    :meth:`adapt`).

    Args:
        base: the full model's projections' shapes (:meth:`BaseTargets.of`) and the number
            of layers.
        max_loras: slots (adapters that can run in one step).
        max_rank: the largest rank an adapter may have (``max_lora_rank``).
        dtype, device: of the model.
        layout: this rank's share (:class:`TPLayout`); None: one rank, all of it.
    """

    def __init__(self, base: BaseTargets, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, layout: TPLayout | None = None) -> None:
        self.base, self.max_loras, self.max_rank = base, max_loras, max_rank
        self.dtype = dtype
        # projection name -> (axis, start, length) of this rank's share, or None: all of it
        self.cuts: dict[str, ShardSlice | None] = dict.fromkeys(base.shapes)
        if layout is not None and layout.sharded:
            self.cuts = dict(shard_slices(layout))
        self.shapes = {name: self._local(name) for name in base.shapes}
        self.rows: LoRARows | None = None      # this step's rows, None: no adapter row
        # layer -> LayerOps field -> (lora_a [S, n R, in], lora_b [S, sum(out), n R])
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(base.num_layers):
            layer = {}
            for field, names in _FUSED.items():
                width = self.shapes[names[0]][0]
                out = sum(self.shapes[n][1] for n in names)
                rank = len(names) * max_rank
                # NOTE: lora_b is the [S, out, R'] view of an [S, R', out] tensor: the stacked
                # path's expand then reads it as one [S * R', out] matrix without a copy
                b = torch.zeros(max_loras, rank, out, dtype=dtype, device=device)
                layer[field] = (torch.zeros(max_loras, rank, width, dtype=dtype, device=device),
                                b.transpose(1, 2))
            self.stacks.append(layer)

    def _local(self, name: str) -> tuple[int, int]:
        """``(in, out)`` features of ``name`` on this rank."""
        width, out = self.base.shapes[name]
        cut = self.cuts[name]
        if cut is None:
            return width, out
        return (width, cut.length) if cut.axis == "out" else (cut.length, out)

    def shard(self, name: str, a: torch.Tensor, b: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of one module's ``A [r, in]`` and ``B [out, r]`` (views)."""
        cut = self.cuts[name]
        if cut is None:
            return a, b
        if cut.axis == "out":
            return a, b[cut.start:cut.start + cut.length]
        return a[:, cut.start:cut.start + cut.length], b

    def set_step(self, token_slots: torch.Tensor | None) -> None:
        """The next step's slot of each token row (``[T]`` int64, ``-1``: base), or ``None``
        when no row uses an adapter."""
        self.rows = None if token_slots is None else \
            LoRARows.of(token_slots, self.max_loras, self.dtype)

    @property
    def nbytes(self) -> int:
        """Device bytes of all slots."""
        return sum(a.nbytes + b.nbytes for layer in self.stacks for a, b in layer.values())

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (it then adds nothing)."""
        for layer in self.stacks:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put ``adapter`` into ``slot``: each module's ``A`` in its shard's rank rows, its
        ``B`` in its shard's output rows and rank columns, the rest zero.

        Raises:
            LoRAAdapterError: a rank above ``max_rank`` or shapes of another base (the
                adapter's :class:`AdapterSpec` was checked against another base).
        """
        if adapter.spec.max_rank > self.max_rank:
            raise LoRAAdapterError(f"LoRA adapter {adapter.spec.path}: rank "
                                   f"{adapter.spec.max_rank} is above max_lora_rank "
                                   f"{self.max_rank}", param="lora_path")
        self.clear(slot)
        for field, names in _FUSED.items():
            row = 0
            for shard, name in enumerate(names):
                out = self.shapes[name][1]
                for layer, stack in enumerate(self.stacks):
                    pair = adapter.tensors.get((layer, name))
                    if pair is None:
                        continue
                    a, b = pair
                    if (a.shape[1], b.shape[0]) != self.base.shapes[name]:
                        raise LoRAAdapterError(
                            f"LoRA adapter {adapter.spec.path}: layer {layer} {name} has "
                            f"shapes {tuple(a.shape)} / {tuple(b.shape)}, not those of this "
                            f"base", param="lora_path")
                    a, b = self.shard(name, a, b)
                    rank, at = a.shape[0], shard * self.max_rank
                    stack_a, stack_b = stack[field]
                    if a.shape[1] != stack_a.shape[2] or b.shape[0] != out:
                        raise LoRAAdapterError(
                            f"LoRA adapter {adapter.spec.path}: layer {layer} {name} has "
                            f"shapes {tuple(a.shape)} / {tuple(b.shape)}, not those of this "
                            f"base", param="lora_path")
                    stack_a[slot, at:at + rank].copy_(a)
                    stack_b[slot, row:row + out, at:at + rank].copy_(b)
                row += out

    def adapt(self, layer: int) -> Callable[[str, Fn], Fn]:
        """For :meth:`LayerOps.of <nybble.models.layer_ops.LayerOps.of>`: ``(field, base)
        -> base`` adding the step's LoRA updates, for ``field`` in ``qkv``, ``o_proj``,
        ``gate_up``, ``down`` of decoder layer ``layer`` (applied before a row-parallel
        projection's all-reduce)."""
        stacks = self.stacks[layer]
        return lambda field, base: self._projection(base, *stacks[field])

    def _projection(self, base: Fn, lora_a: torch.Tensor, lora_b: torch.Tensor) -> Fn:
        def run(x: torch.Tensor) -> torch.Tensor:
            y = base(x)
            rows = self.rows
            return y if rows is None else add_lora(y, x, lora_a, lora_b, rows)
        return run


assert set(n for names in _FUSED.values() for n in names) == set(LORA_MODULES)
