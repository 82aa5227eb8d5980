"""The sparse mixture-of-experts MLP block of Qwen3-MoE and Mixtral (:class:`MoEBlock`).

``router`` (a bias-free linear ``[T, H] -> [T, E]``) scores the experts; each token goes to the
``top_k`` most probable (:func:`nybble.kernels.reference.moe.route_topk`: softmax, top-k,
optional renormalisation); the experts' SwiGLU outputs are summed with those weights. Routing:
Shazeer et al. 2017, Switch Transformer (Fedus et al. 2021), Mixtral (Jiang et al. 2024),
Qwen3 technical report (2025).

Two ways of holding the experts, chosen at build time by the linear factory:

* dense (float checkpoints): stacked ``w13 [E, 2I, H]`` (each expert's gate rows then up rows)
  and ``w2 [E, H, I]``, filled expert by expert at load (:meth:`MoEBlock.load_expert`), run
  by :func:`nybble.kernels.moe_ops.fused_experts` (Triton grouped GEMM on CUDA, the torch
  reference elsewhere);
* quantized (the factory builds a module for the experts' projections: GPTQ/AWQ...): one
  fused gate/up and one down linear per expert, as a dense layer's, loaded by the loader's
  usual shard fusing, run one expert at a time on its gathered tokens
  (:func:`nybble.kernels.reference.moe.grouped_experts`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nybble.errors import UnsupportedModelError
from nybble.kernels import moe_ops
from nybble.kernels.reference.moe import gated, grouped_experts, route_topk
from nybble.models.arch import MoESpec
from nybble.models.linear import LinearFactory, as_function, build_linear, dense_linear_factory
from nybble.models.tp_layout import ShardSlice

Fn = Callable[[torch.Tensor], torch.Tensor]


class MoEBlock(nn.Module):
    """One layer's MoE MLP: ``x [T, H] -> [T, H]`` (in ``x.dtype``).

    Under tensor parallelism each rank holds features ``[start, start + I / N)`` of every
    expert's intermediate dimension (``inter_slice`` of gate/up's outputs, ``down_slice`` of
    down's inputs; :class:`~nybble.models.tp_layout.TPLayout`), the router whole; the block's
    output is then this rank's partial sum (the layer all-reduces it).

    Args:
        spec: the family's :class:`MoESpec`.
        prefix: the block's checkpoint name (``model.layers.N.mlp``).
        hidden: ``H``. linear: the model's linear factory (decides dense or quantized
            experts). activation: the config's ``hidden_act``.
        inter_slice, down_slice: this rank's shares (None: one rank, the whole experts).

    Attributes:
        router: the dense ``[E, H]`` router linear (never quantized).
        w13, w2: the stacked dense experts, or None when the experts are quantized.
        gate_up, down: the per-expert quantized linears (``[H] -> [2I]``, ``[I] -> [H]``), or
            None for dense experts.
        expert_prefixes: checkpoint module name -> ``(expert, part)`` with part 0 gate, 1 up,
            2 down, for the stacked experts (empty when quantized: the per-expert modules
            carry their own ``shard_prefixes``).

    Raises:
        UnsupportedModelError: an activation other than ``silu``.
    """

    def __init__(self, spec: MoESpec, prefix: str, hidden: int, linear: LinearFactory,
                 activation: str, dtype: torch.dtype, device: torch.device,
                 inter_slice: ShardSlice | None = None,
                 down_slice: ShardSlice | None = None) -> None:
        super().__init__()
        if activation != "silu":
            raise UnsupportedModelError(f"hidden_act of a mixture-of-experts model must be "
                                        f"silu, got {activation!r}")
        num = spec.num_experts
        inter = spec.intermediate_size if inter_slice is None else inter_slice.length
        self.inter_start = 0 if inter_slice is None else inter_slice.start
        self.full_intermediate = spec.intermediate_size
        self.num_experts, self.top_k, self.renormalize = num, spec.top_k, spec.renormalize
        self.intermediate_size, self.hidden_size = inter, hidden   # this rank's I
        self.weights_in_logits_dtype = spec.weights_in_logits_dtype
        self.router = build_linear(dense_linear_factory, [f"{prefix}.gate"], hidden, [num],
                                   False, dtype, device)
        gate, up, down = spec.projections
        names = [[f"{prefix}.experts.{e}.{p}" for p in (gate, up, down)] for e in range(num)]
        probe = linear(names[0][:2], hidden, [inter, inter], False, dtype, device)
        self.w13: nn.Parameter | None = None
        self.w2: nn.Parameter | None = None
        self.gate_up: nn.ModuleList | None = None
        self.down: nn.ModuleList | None = None
        self.expert_prefixes: dict[str, tuple[int, int]] = {}
        if probe is None:
            self.w13 = nn.Parameter(torch.empty(num, 2 * inter, hidden, dtype=dtype,
                                                device=device), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num, hidden, inter, dtype=dtype, device=device),
                                   requires_grad=False)
            self.expert_prefixes = {n: (e, part) for e, trio in enumerate(names)
                                    for part, n in enumerate(trio)}
            self._loaded: set[tuple[int, int]] = set()
        else:
            self.gate_up = nn.ModuleList(
                build_linear(linear, trio[:2], hidden, [inter, inter], False, dtype, device)
                for trio in names)
            self.down = nn.ModuleList(
                build_linear(linear, [trio[2]], inter, [hidden], False, dtype, device)
                for trio in names)
            if inter_slice is not None and down_slice is not None:   # read by the loader
                for gate_up, down_proj in zip(self.gate_up, self.down):
                    gate_up.tp_slices = [inter_slice, inter_slice]
                    down_proj.tp_slices = [down_slice]

    def load_expert(self, expert: int, part: int, name: str, tensor: Any) -> None:
        """Copy checkpoint tensor ``name`` of expert ``expert``'s projection ``part`` (0 gate
        ``[I, H]``, 1 up ``[I, H]``, 2 down ``[H, I]``; a tensor, or a safetensors slice of
        which only this rank's share is read) into the stacked weights.

        Raises:
            UnsupportedModelError: a tensor other than ``weight`` (a quantized expert in a
                checkpoint whose other experts are not) or a shape that does not fit.
        """
        assert self.w13 is not None and self.w2 is not None
        inter, start = self.intermediate_size, self.inter_start
        if name != "weight":
            raise UnsupportedModelError(
                f"expert {expert} of a float MoE block must hold a 'weight' tensor, got "
                f"{name!r} (experts must be all quantized or all float)")
        target = (self.w2[expert] if part == 2 else
                  self.w13[expert, part * inter:(part + 1) * inter])
        shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
        full, hidden = self.full_intermediate, self.hidden_size
        want = (hidden, full) if part == 2 else (full, hidden)
        if shape != want:
            raise UnsupportedModelError(f"expert {expert} projection {part} must have shape "
                                        f"{want}, got {shape}")
        part_of = (tensor[:, start:start + inter] if part == 2 else
                   tensor[start:start + inter])
        target.copy_(part_of.to(target.dtype))
        self._loaded.add((expert, part))

    def missing_experts(self) -> list[str]:
        """Checkpoint names of the stacked experts' projections not loaded yet."""
        return [n for n, slot in self.expert_prefixes.items() if slot not in self._loaded]

    def as_function(self) -> Fn:
        """The block as a plain callable ``x [T, H] -> [T, H]`` bound to its weights."""
        router = as_function(self.router)
        top_k, renorm, cast = self.top_k, self.renormalize, self.weights_in_logits_dtype
        if self.w13 is not None and self.w2 is not None:
            w13, w2 = self.w13, self.w2

            def run(x: torch.Tensor) -> torch.Tensor:
                logits = router(x)
                weights, ids = route_topk(logits, top_k, renorm,
                                          logits.dtype if cast else None)
                return moe_ops.fused_experts(x, w13, w2, weights, ids)
            return run
        assert self.gate_up is not None and self.down is not None
        gate_ups = [as_function(m) for m in self.gate_up]
        downs = [as_function(m) for m in self.down]
        num = self.num_experts

        def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
            return downs[e](gated(gate_ups[e](xe)))

        def run_quantized(x: torch.Tensor) -> torch.Tensor:
            logits = router(x)
            weights, ids = route_topk(logits, top_k, renorm, logits.dtype if cast else None)
            return grouped_experts(x, weights, ids, num, expert)
        return run_quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H] -> [T, H]``."""
        return self.as_function()(x)
