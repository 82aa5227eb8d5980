"""What each rank holds (TPLayout), slicing checkpoint tensors (read_shard) with its errors,
and the step payload round trip; one process, no collectives."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nybble.distributed.comm import TPGroup
from nybble.errors import UnsupportedModelError
from nybble.models.linear import DenseLinear
from nybble.models.shape import ModelShape
from nybble.models.tp_layout import ShardSlice, TPLayout
from nybble.models.tp_shard import read_shard, read_vocab_rows
from nybble.quant.linear import GPTQLinear
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.executor.step_payload import pack_step, unpack_step


def _shape(heads: int = 8, kv: int = 4, vocab: int = 10) -> ModelShape:
    return ModelShape(num_layers=2, num_heads=heads, num_kv_heads=kv, head_dim=4,
                      hidden_size=heads * 4, vocab_size=vocab)


def test_layout_splits_heads_mlp_and_vocabulary():
    lay = TPLayout.of(_shape(), 12, TPGroup(1, 2))
    assert (lay.num_heads, lay.num_kv_heads) == (4, 2)
    assert lay.q == ShardSlice("out", 16, 16, 32)
    assert lay.kv == ShardSlice("out", 8, 8, 16)
    assert lay.inter == ShardSlice("out", 6, 6, 12)
    assert lay.o_in == ShardSlice("in", 16, 16, 32) and lay.down_in == ShardSlice("in", 6, 6, 12)
    assert (lay.vocab_start, lay.vocab_rows) == (5, 5)


def test_fewer_kv_heads_than_ranks_replicates_them():
    got = [TPLayout.of(_shape(kv=2), 16, TPGroup(r, 4)).kv for r in range(4)]
    assert [s.start for s in got] == [0, 0, 4, 4] and {s.length for s in got} == {4}


@pytest.mark.parametrize(("heads", "kv", "inter", "what"), [
    (6, 2, 16, "num_attention_heads"), (8, 6, 16, "num_key_value_heads"),
    (8, 4, 10, "intermediate_size"), (12, 3, 16, "multiple of num_key_value_heads")])
def test_uneven_splits_are_refused_with_the_sizes(heads, kv, inter, what):
    with pytest.raises(UnsupportedModelError, match=what):
        TPLayout.of(_shape(heads, kv), inter, TPGroup(0, 4))


def test_vocab_rows_of_the_last_rank_are_zero_padded(tmp_path):
    w = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    save_file({"e": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        last = read_vocab_rows(f, "e", 8, 4)
    assert torch.equal(last[:2], w[8:]) and not last[2:].any()


def _gptq_file(tmp_path, k: int = 64, n: int = 16, groups: int = 2) -> str:
    path = str(tmp_path / "q.safetensors")
    save_file({"l.qweight": torch.arange(k // 8 * n, dtype=torch.int32).reshape(k // 8, n),
               "l.qzeros": torch.arange(groups * n // 8, dtype=torch.int32).reshape(groups, -1),
               "l.scales": torch.rand(groups, n).half(),
               "l.g_idx": (torch.arange(k) // (k // groups)).int(),
               "l.bias": torch.ones(n).half()}, path)
    return path


def test_row_parallel_gptq_slices_packed_rows_groups_and_rebases_g_idx(tmp_path):
    mod = GPTQLinear(32, 16, True, torch.float16, torch.device("cpu"), 4, 32, 1, True)
    sl = ShardSlice("in", 32, 32, 64)
    with safe_open(_gptq_file(tmp_path), "pt") as f:
        qw, qz, g, bias = (read_shard(f, f"l.{n}", n, mod, sl, 1, False)
                           for n in ("qweight", "qzeros", "g_idx", "bias"))
        full = f.get_tensor("l.qweight")
    assert torch.equal(qw, full[4:8])          # 8 input rows per packed int32
    assert qz.shape == (1, 2) and torch.equal(g, torch.zeros(32, dtype=torch.int32))
    assert not bias.any()        # a row-parallel bias is added once, by rank 0


def test_column_parallel_gptq_splits_output_columns(tmp_path):
    mod = GPTQLinear(64, 16, False, torch.float16, torch.device("cpu"), 4, 32, 1, True)
    with safe_open(_gptq_file(tmp_path), "pt") as f:
        qz = read_shard(f, "l.qzeros", "qzeros", mod, ShardSlice("out", 8, 8, 16), 1, False)
        g = read_shard(f, "l.g_idx", "g_idx", mod, ShardSlice("out", 8, 8, 16), 1, False)
        assert torch.equal(qz, f.get_tensor("l.qzeros")[:, 1:2]) and g.shape == (64,)


@pytest.mark.parametrize(("name", "sl", "match"), [
    ("scales", ShardSlice("in", 16, 16, 64), "each group covers 32 features"),
    ("qzeros", ShardSlice("out", 4, 4, 16), "each packed entry covers 8 features")])
def test_a_split_inside_a_group_or_packed_entry_is_refused(tmp_path, name, sl, match):
    mod = GPTQLinear(16, 16, False, torch.float16, torch.device("cpu"), 4, 32, 1, True)
    with safe_open(_gptq_file(tmp_path), "pt") as f, \
            pytest.raises(UnsupportedModelError, match=f"l.{name}: {match}"):
        read_shard(f, f"l.{name}", name, mod, sl, 1, False)


def test_dense_row_parallel_weight_takes_its_input_columns(tmp_path):
    w = torch.randn(6, 8)
    save_file({"w": w}, str(tmp_path / "d.safetensors"))
    mod = DenseLinear(4, 6, False, torch.float32, torch.device("cpu"))
    with safe_open(str(tmp_path / "d.safetensors"), "pt") as f:
        assert torch.equal(read_shard(f, "w", "weight", mod, ShardSlice("in", 4, 4, 8), 1,
                                      False), w[:, 4:])


def test_step_payload_round_trip():
    rng = np.random.default_rng(0)
    b = ScheduledBatch(
        num_seqs=2, num_tokens=5, max_query_len=4, max_seq_len=9,
        input_ids=rng.integers(0, 500, 5).astype(np.int32),
        positions=np.array([5, 6, 7, 8, 3], np.int64),
        slot_mapping=rng.integers(0, 99, 5).astype(np.int64),
        block_tables=np.array([[1, 2, -1], [4, -1, -1]], np.int32),
        seq_lens=np.array([9, 4], np.int32), query_start_loc=np.array([0, 4, 5], np.int32),
        seq_ids=np.array([3, 8]), sample_rows=np.array([3, 4], np.int32),
        sample_seq_ids=np.array([3, 8]), copy_src=np.array([7], np.int32),
        copy_dst=np.array([9], np.int32))
    ints, payload = pack_step(b)
    assert payload.dtype == torch.int64 and payload.numel() == 3 * 5 + 6 + 2 + 3 + 2
    got, slots = unpack_step(tuple(ints), payload)
    assert slots is None
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start_loc", "copy_src", "copy_dst"):
        a, e = getattr(got, name), getattr(b, name)
        assert a.dtype == e.dtype and np.array_equal(a, e), name
    assert (got.num_tokens, got.max_query_len, got.max_seq_len) == (5, 4, 9)
    with pytest.raises(ValueError, match="must hold 28 int64 values"):
        unpack_step(tuple(ints), payload[:-1])
    # a LoRA step: each row's adapter slot follows the arrays
    token_slots = torch.tensor([-1, 0, 0, 2, 1])
    ints, payload = pack_step(b, token_slots)
    got, slots = unpack_step(tuple(ints), payload)
    assert payload.numel() == 28 + 5 and torch.equal(slots, token_slots)
    assert np.array_equal(got.copy_dst, b.copy_dst)
