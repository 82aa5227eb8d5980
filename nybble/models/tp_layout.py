"""How a Llama-family decoder splits over a tensor-parallel group (Megatron-LM, Shoeybi et
al. 2019): what each rank holds.

* q/k/v and gate/up are column-parallel: rank ``r`` holds output features ``[r * n / N,
  (r + 1) * n / N)`` of each shard (whole heads of q; of k/v too, or one replicated KV head
  when the model has fewer KV heads than ranks).
* o_proj and down_proj are row-parallel: rank ``r`` holds the matching input features, and
  the partial outputs are summed by one all-reduce.
* A mixture-of-experts block (Qwen3-MoE, Mixtral) splits every expert like a dense MLP: rank
  ``r`` holds features ``[r * I / N, (r + 1) * I / N)`` of each expert's gate, up (columns)
  and down (rows) projections, the router is replicated (every rank routes the same tokens
  the same way) and the block's partial outputs are summed by one all-reduce.
* The embedding and the LM head are vocabulary-parallel: ``ceil(V / N)`` rows per rank (the
  last rank's tail padded with zero rows); the embedding's lookups are summed by an
  all-reduce, the logits gathered on rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass

from nybble.distributed.comm import TPGroup
from nybble.errors import UnsupportedModelError
from nybble.models.shape import ModelShape


@dataclass(frozen=True)
class ShardSlice:
    """The part of one checkpoint projection a rank holds, in logical features.

    Attributes:
        axis: ``"out"`` (column-parallel: a range of output features) or ``"in"``
            (row-parallel: a range of input features).
        start, length: the range (features).
        full: the projection's whole width along ``axis`` (features).
    """

    axis: str
    start: int
    length: int
    full: int


@dataclass(frozen=True)
class TPLayout:
    """This rank's share of the model (``world_size`` 1: everything).

    Attributes:
        tp: the group.
        num_heads, num_kv_heads: query and KV heads this rank computes.
        q, kv, inter: column slices of q_proj, of k_proj/v_proj and of gate_proj/up_proj.
        o_in, down_in: row slices of o_proj and down_proj (the inputs of ``q`` and ``inter``).
        vocab_start, vocab_rows: this rank's embedding / LM-head rows (``vocab_rows`` per
            rank, padding included).
        expert_inter, expert_down_in: column slice of every expert's gate/up projection and
            row slice of its down projection (mixture-of-experts models), or None.
    """

    tp: TPGroup
    num_heads: int
    num_kv_heads: int
    q: ShardSlice
    kv: ShardSlice
    inter: ShardSlice
    o_in: ShardSlice
    down_in: ShardSlice
    vocab_start: int
    vocab_rows: int
    expert_inter: ShardSlice | None = None
    expert_down_in: ShardSlice | None = None

    @classmethod
    def of(cls, shape: ModelShape, intermediate_size: int, tp: TPGroup,
           expert_intermediate_size: int | None = None) -> TPLayout:
        """Split ``shape`` over ``tp`` (and each expert of width ``expert_intermediate_size``,
        for a mixture-of-experts model).

        Raises:
            UnsupportedModelError: heads, KV heads, ``intermediate_size`` or the experts'
                intermediate size that do not divide evenly over the ranks (the message names
                the sizes allowed).
        """
        n, r = tp.world_size, tp.rank
        hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim

        def need(ok: bool, what: str, value: int) -> None:
            if not ok:
                raise UnsupportedModelError(
                    f"{what} must split evenly over tensor_parallel_size {n}, got {value}")

        need(hq % n == 0, "num_attention_heads", hq)
        need(intermediate_size % n == 0, "intermediate_size", intermediate_size)
        if hkv >= n:
            need(hkv % n == 0, "num_key_value_heads", hkv)
            kv_heads, kv_first = hkv // n, r * (hkv // n)
        else:   # fewer KV heads than ranks: each KV head is replicated on n / hkv ranks
            need(n % hkv == 0, "tensor_parallel_size (a multiple of num_key_value_heads)", n)
            kv_heads, kv_first = 1, r // (n // hkv)
        experts: tuple[ShardSlice | None, ShardSlice | None] = (None, None)
        if expert_intermediate_size is not None:
            need(expert_intermediate_size % n == 0, "moe_intermediate_size (each expert's "
                 "intermediate size)", expert_intermediate_size)
            ei = expert_intermediate_size // n
            experts = (ShardSlice("out", r * ei, ei, expert_intermediate_size),
                       ShardSlice("in", r * ei, ei, expert_intermediate_size))
        heads = hq // n
        i = intermediate_size // n
        q = ShardSlice("out", r * heads * d, heads * d, hq * d)
        vocab_rows = -(-shape.vocab_size // n)
        return cls(tp, heads, kv_heads, q,
                   ShardSlice("out", kv_first * d, kv_heads * d, hkv * d),
                   ShardSlice("out", r * i, i, intermediate_size),
                   ShardSlice("in", q.start, q.length, q.full),
                   ShardSlice("in", r * i, i, intermediate_size),
                   r * vocab_rows, vocab_rows, *experts)

    @property
    def sharded(self) -> bool:
        """Whether there is more than one rank."""
        return self.tp.world_size > 1
