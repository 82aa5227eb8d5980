"""LoRAManager: the host LRU of loaded adapters, the device slots it fills (pinned while used,
least recently used reused first), and the per-row slots of a step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble.config import DEFAULT_MODEL, LoRAConfig, ModelConfig
from nybble.errors import LoRAAdapterError
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.lora_request import LoRARequest
from nybble.models.loader import load_model
from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.worker.lora_manager import LoRAManager
from tests.lora.adapters import make_adapter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(DEFAULT_MODEL, str(root / f"a{i}"), r=4 * (i + 1), alpha=8, seed=i)
            for i in range(3)]


def _manager(max_loras: int, max_cpu_loras: int | None = None) -> LoRAManager:
    loaded = load_model(ModelConfig(model=DEFAULT_MODEL, dtype="float32"),
                        TorchAttentionBackend(), torch.device("cpu"))
    return LoRAManager(loaded.model, LoRAConfig(enable_lora=True, max_loras=max_loras,
                                                max_lora_rank=16, max_cpu_loras=max_cpu_loras))


def test_slots_are_pinned_while_used_and_reused_least_recently_used_first(folders) -> None:
    m = _manager(max_loras=2, max_cpu_loras=3)
    a, b, c = (LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders))
    sa, sb = m.acquire(a), m.acquire(b)
    assert {sa, sb} == {0, 1}
    assert m.acquire(a) == sa                         # resident: same slot, pinned twice
    assert m.acquire(c) is None                       # every slot pinned: wait
    m.release(sb)
    assert m.acquire(c) == sb                         # b's unpinned slot goes to c
    assert m.running_adapters() == {1: 2, 3: 1}
    m.release(sa), m.release(sa)
    stack_a = m.slots.stacks[0]["qkv"][0]
    assert stack_a[sa].abs().sum() > 0
    assert m.acquire(b) == sa and m.running_adapters() == {2: 1, 3: 1}


def test_host_cache_keeps_max_cpu_loras_and_never_evicts_a_running_adapter(folders) -> None:
    m = _manager(max_loras=1, max_cpu_loras=2)
    a, b, c = (LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders))
    m.acquire(a)
    m.load(b)
    m.load(c)                                  # evicts b (a runs), keeps a and c
    assert list(m._host) == [1, 3]


def test_an_id_reused_for_another_folder_is_refused(folders) -> None:
    m = _manager(max_loras=1)
    m.load(LoRARequest("x", 1, folders[0]))
    with pytest.raises(LoRAAdapterError, match="lora_int_id 1 names"):
        m.load(LoRARequest("y", 1, folders[1]))


def test_token_slots_follow_each_rows_sequence(folders) -> None:
    m = _manager(max_loras=2)
    m.assign(10, 2, 1)                         # sequences 10, 11 under slot 1
    m.assign(5000, 1, 0)                       # grows the table
    e = np.zeros(0, np.int32)
    batch = ScheduledBatch(
        num_seqs=4, num_tokens=7, max_query_len=3, max_seq_len=3, input_ids=e, positions=e,
        slot_mapping=e, block_tables=e, seq_lens=e,
        query_start_loc=np.array([0, 3, 4, 6, 7], np.int32),
        seq_ids=np.array([10, 3, 5000, 99999], np.int64), sample_rows=e, sample_seq_ids=e,
        copy_src=e, copy_dst=e)
    assert m.token_slots(batch).tolist() == [1, 1, 1, -1, 0, 0, -1]
    m.forget(10, 2), m.forget(5000, 1)
    assert m.token_slots(batch) is None        # no adapter row: nothing extra runs
