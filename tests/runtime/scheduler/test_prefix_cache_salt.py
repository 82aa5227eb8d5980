"""The prefix cache's chain root (``cache_salt``): a LoRA adapter's requests chain their block
hashes from their own root, so KV computed under one adapter is never reused by another or by
the base model, while requests of the same adapter still share their prefixes. Both the
Cython scheduler and its plain-Python reference obey it."""
from __future__ import annotations

import numpy as np
import pytest
from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler
from nybble.runtime.scheduler.scheduler import Scheduler

from tests.runtime.helpers import make_scheduler


def _finish(sched) -> None:
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update(batch, np.full(batch.num_sampled, 7, np.int32))


def _hit_of(sched, seq_id: int, prompt: np.ndarray, salt: int) -> int:
    """Prefix-cache hit tokens of ``prompt`` added under ``salt`` (run to the end)."""
    before = sched.num_prefix_hit_tokens
    sched.add(seq_id, prompt, 2, cache_salt=salt)
    _finish(sched)
    return sched.num_prefix_hit_tokens - before


@pytest.mark.parametrize("impl", [Scheduler, ReferenceScheduler])
def test_blocks_are_shared_within_a_root_and_never_across_roots(impl: type) -> None:
    sched, _ = make_scheduler(impl, num_blocks=64, block_size=4, max_num_batched_tokens=64,
                              max_model_len=64, enable_prefix_caching=True)
    prompt = np.arange(100, 117, dtype=np.int32)          # 17 tokens: 4 full blocks
    assert _hit_of(sched, 0, prompt, salt=0) == 0
    assert _hit_of(sched, 1, prompt, salt=0) == 16        # base after base: shared
    assert _hit_of(sched, 2, prompt, salt=12345) == 0     # adapter after base: not shared
    assert _hit_of(sched, 3, prompt, salt=12345) == 16    # same adapter: shared
    assert _hit_of(sched, 4, prompt, salt=999) == 0       # another adapter: not shared
    assert _hit_of(sched, 5, prompt, salt=0) == 16        # base still finds its own


def test_a_salted_chain_differs_from_the_root_chain_in_the_cython_cache() -> None:
    sched, _ = make_scheduler(Scheduler, num_blocks=16, block_size=4, max_num_batched_tokens=64,
                              max_model_len=64, enable_prefix_caching=True)
    prompt = np.arange(1, 10, dtype=np.int32)
    sched.add(0, prompt, 2, cache_salt=77)
    _finish(sched)
    assert sched.prefix_cache.match(prompt[:8]).size == 0
    assert sched.prefix_cache.match(prompt[:8], 77).size == 2


@pytest.mark.parametrize("impl", [Scheduler, ReferenceScheduler])
def test_a_preempted_salted_sequence_finds_its_own_blocks_again(impl: type) -> None:
    sched, _ = make_scheduler(impl, num_blocks=7, block_size=4, enable_prefix_caching=True)
    for i in range(2):
        sched.add(i, (100 * (i + 1) + np.arange(8)).astype(np.int32), 12, cache_salt=5 + i)
    while sched.num_preemptions == 0:
        batch = sched.schedule()
        sched.update(batch, np.full(batch.num_sampled, 5, np.int32))
    hits = sched.num_prefix_hit_tokens
    _finish(sched)
    assert sched.num_prefix_hit_tokens > hits
    assert sched.num_free_blocks == 7
