"""Automatic prefix caching: the hash chain, the allocator's LRU of parked blocks, admission
with cached prefixes in the scheduler, and engine outputs with caching on == off."""
from __future__ import annotations

import argparse
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from nybble.runtime.scheduler.block_allocator import BlockAllocator
from nybble.runtime.scheduler.prefix_cache import hash_tokens
from nybble.runtime.scheduler.scheduler import Scheduler

from nybble.config import EngineConfig
from nybble.engine_args import add_engine_args, engine_config_from_args
from tests.runtime.helpers import check_batch_invariants, check_state_invariants, make_scheduler


def chain(tokens: Any, bs: int) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (the reference the cache must agree with)."""
    out, parent = [], 0
    for k in range(len(tokens) // bs):
        parent = hash_tokens(parent, np.asarray(tokens[k * bs:(k + 1) * bs], np.int32))
        out.append(parent)
    return out


# ---- hash + allocator units ------------------------------------------------------------------

def test_hash_is_chained_and_deterministic() -> None:
    a, b = np.arange(4, dtype=np.int32), np.arange(1, 5, dtype=np.int32)
    assert hash_tokens(0, a) == hash_tokens(0, a.copy())
    assert hash_tokens(0, a) != hash_tokens(0, b)
    assert hash_tokens(0, a) != hash_tokens(hash_tokens(0, b), a)   # same block, other prefix
    assert 0 <= hash_tokens(2**64 - 1, a) < 2**64


def test_parked_blocks_count_free_and_are_evicted_last_and_lru_first() -> None:
    alloc = BlockAllocator(4, 2, enable_prefix_caching=True)
    cache = alloc.prefix_cache
    toks = np.array([5, 6, 7, 8], np.int32)
    b0, b1 = alloc.allocate(), alloc.allocate()
    h0 = alloc.register(b0, 0, toks[:2])
    assert alloc.register(b1, h0, toks[2:]) == chain(toks, 2)[1]
    assert cache.match(toks).tolist() == [b0, b1]
    alloc.free(b1)
    alloc.free(b0)                              # parked: b1 first (LRU), then b0
    assert alloc.num_free_blocks == 4 and cache.num_evictable_blocks == 2
    assert alloc.debug_state()["evictable"] == [b1, b0]
    assert cache.match(toks).tolist() == [b0, b1]        # still findable
    fresh = {alloc.allocate(), alloc.allocate()}
    assert fresh.isdisjoint({b0, b1})                      # truly free blocks go first
    assert alloc.allocate() == b1                          # then the LRU parked block
    assert cache.match(toks).tolist() == [b0] and cache.num_evictions == 1
    alloc.incref(b0)                                       # a hit unparks it
    assert alloc.ref_count(b0) == 1 and alloc.allocate() is None
    with pytest.raises(RuntimeError, match="was incref'd while it is free"):
        BlockAllocator(2, 2, enable_prefix_caching=True).incref(0)
    with pytest.raises(ValueError, match="register\\(\\) needs prefix caching"):
        BlockAllocator(2, 2).register(0, 0, [1, 2])


def test_collision_check_rejects_other_tokens_under_same_chain() -> None:
    alloc = BlockAllocator(4, 2, enable_prefix_caching=True)
    b = alloc.allocate()
    alloc.register(b, 0, [1, 2])
    assert alloc.prefix_cache.match([1, 2]).tolist() == [b]
    assert alloc.prefix_cache.match([1, 3]).tolist() == []
    d = alloc.allocate()                         # same content, second block: not cached
    assert alloc.register(d, 0, [1, 2]) == hash_tokens(0, [1, 2])
    assert alloc.prefix_cache.num_cached_blocks == 1
    alloc.free(d)
    assert alloc.prefix_cache.num_evictable_blocks == 0   # uncached: back on the free stack


class PrefixAllocatorMachine(RuleBasedStateMachine):
    """Owners admit token sequences through the cache, as the scheduler does; ``content[b]`` is
    the token prefix whose KV block ``b`` holds (what a forward pass wrote there)."""

    N, BS = 10, 2

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(self.N, self.BS, enable_prefix_caching=True)
        self.cache = self.alloc.prefix_cache
        self.owners: list[list[int]] = []
        self.content: dict[int, tuple] = {}
        self.junk = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8))
    def admit(self, tokens: list[int]) -> None:
        bs = self.BS
        hits = self.cache.match(tokens).tolist()[:(len(tokens) - 1) // bs]
        for k, b in enumerate(hits):              # no false hits: same prefix, same KV
            assert self.content[b] == tuple(tokens[:(k + 1) * bs])
        need = -(-len(tokens) // bs) - len(hits)
        for b in hits:
            self.alloc.incref(b)
        if need > self.alloc.num_free_blocks:
            for b in reversed(hits):
                self.alloc.free(b)
            return
        table = hits + [self.alloc.allocate() for _ in range(need)]
        assert None not in table
        hashes, parent = chain(tokens, bs), 0
        for k, b in enumerate(table):
            if k >= len(hits):                    # "compute" the block
                self.content[b] = tuple(tokens[:min((k + 1) * bs, len(tokens))])
            if (k + 1) * bs <= len(tokens):
                parent = self.alloc.register(b, parent, tokens[k * bs:(k + 1) * bs])
                assert parent == hashes[k]
        self.owners.append(table)

    @rule(i=st.integers(0, 100))
    def pressure(self, i: int) -> None:
        b = self.alloc.allocate()                 # an uncached block with other content
        if b is not None:
            self.junk += 1
            self.content[b] = ("junk", self.junk)
            self.owners.append([b])

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        table = list(self.owners[i % len(self.owners)])
        self.alloc.fork(table)
        self.owners.append(table)

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        for b in reversed(self.owners.pop(i % len(self.owners))):
            self.alloc.free(b)

    @invariant()
    def ownership_free_list_and_cache_agree(self) -> None:
        state = self.alloc.debug_state()
        ref = state["ref_counts"].tolist()
        held = Counter(b for t in self.owners for b in t)
        assert ref == [held.get(b, 0) for b in range(self.N)]
        free = state["free_list"].tolist()
        assert len(free) == len(set(free)) == self.alloc.num_free_blocks
        assert set(free) == {b for b in range(self.N) if ref[b] == 0}
        cs = self.cache.debug_state()
        assert set(state["evictable"]) == {b for b in cs["hashes"] if ref[b] == 0}
        for b, toks in cs["tokens"].items():      # cached content = its tokens and chain
            prefix = self.content[b]
            assert "junk" not in prefix and len(prefix) % self.BS == 0
            assert toks.tolist() == list(prefix[-self.BS:])
            assert cs["hashes"][b] == chain(prefix, self.BS)[-1]

    def teardown(self) -> None:
        while self.owners:
            self.release(0)
        state = self.alloc.debug_state()
        assert self.alloc.num_free_blocks == self.N and not np.any(state["ref_counts"])
        assert sorted(state["evictable"]) == sorted(self.cache.debug_state()["hashes"])


PrefixAllocatorMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50,
                                                    deadline=None)
TestPrefixAllocatorMachine = PrefixAllocatorMachine.TestCase


# ---- scheduler -------------------------------------------------------------------------------

def _run(sched: Scheduler, cfg: dict[str, Any], token: int = 7) -> None:
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update(batch, np.full(batch.num_sampled, token, np.int32))


def test_second_request_reuses_32_of_40_shared_tokens() -> None:
    sched, cfg = make_scheduler(num_blocks=32, block_size=16, max_num_batched_tokens=256,
                                max_model_len=256, enable_prefix_caching=True)
    prefix = np.arange(100, 140, dtype=np.int32)                    # 40 tokens: 2.5 blocks
    sched.add(0, np.concatenate([prefix, [1, 2, 3]]), 4)
    _run(sched, cfg)
    assert sched.num_prefix_hit_tokens == 0 and sched.num_prefix_query_tokens == 43
    assert sched.prefix_cache.num_cached_blocks == 2                # the 2 full blocks
    b_prompt = np.concatenate([prefix, [9, 8, 7, 6]]).astype(np.int32)
    sched.add(1, b_prompt, 3)
    batch = sched.schedule()
    check_batch_invariants(batch, sched.debug_state(), cfg)
    assert sched.debug_state()["seqs"][1]["num_computed"] == 32     # admitted with 2 hits
    assert batch.num_tokens == 44 - 32
    assert batch.positions.tolist() == list(range(32, 44))
    assert batch.input_ids.tolist() == b_prompt[32:].tolist()
    assert batch.seq_lens.tolist() == [44] and batch.sample_rows.tolist() == [11]
    assert sched.num_prefix_hit_tokens == 32 and sched.num_prefix_query_tokens == 43 + 44
    sched.update(batch, np.array([5], np.int32))
    _run(sched, cfg)
    assert sched.num_free_blocks == 32 and not np.any(sched.debug_state()["ref_counts"])


@pytest.mark.parametrize("prompt_len, hit", [(32, 16), (33, 32), (31, 16)])
def test_last_prompt_token_is_always_computed(prompt_len: int, hit: int) -> None:
    sched, cfg = make_scheduler(num_blocks=16, block_size=16, max_num_batched_tokens=64,
                                max_model_len=128, enable_prefix_caching=True)
    prompt = np.arange(prompt_len, dtype=np.int32)
    sched.add(0, prompt, 2)
    _run(sched, cfg)                  # computes the prompt + 1 generated token
    sched.add(1, prompt, 2)
    batch = sched.schedule()
    assert sched.num_prefix_hit_tokens == hit
    assert batch.num_tokens == prompt_len - sched.num_prefix_hit_tokens >= 1
    assert batch.num_sampled == 1
    sched.update(batch, np.array([3], np.int32))
    _run(sched, cfg)


def test_off_by_default_and_no_stats() -> None:
    sched, cfg = make_scheduler(block_size=4)
    for i in range(2):
        sched.add(i, np.arange(12, dtype=np.int32), 2)
        _run(sched, cfg)
    assert sched.prefix_cache is None
    assert sched.num_prefix_hit_tokens == sched.num_prefix_query_tokens == 0


def test_parallel_sampling_group_hits_and_copies_on_write() -> None:
    sched, cfg = make_scheduler(block_size=4, num_blocks=24, enable_prefix_caching=True)
    prompt = np.arange(10, dtype=np.int32)
    sched.add(0, prompt, 3)
    _run(sched, cfg)
    sched.add(10, prompt, 3, (), 3)
    batch = sched.schedule()
    assert sched.num_prefix_hit_tokens == 8 and batch.num_tokens == 2
    assert batch.sample_seq_ids.tolist() == [10, 11, 12]
    sched.update(batch, np.array([1, 2, 3], np.int32))
    batch = sched.schedule()            # position 10 lands in the shared partial block 2
    assert len(batch.copy_src) == 2
    sched.update(batch, np.full(batch.num_sampled, 4, np.int32))
    _run(sched, cfg)
    state = check_state_invariants(sched, cfg)
    assert sched.num_free_blocks == 24 and not np.any(state["ref_counts"])


def test_preempted_sequence_recomputes_from_its_cached_blocks() -> None:
    # 2 x (8 prompt + 12 generated) tokens need 2 x 5 blocks of 4 > 7 blocks.
    sched, cfg = make_scheduler(num_blocks=7, block_size=4, enable_prefix_caching=True)
    for i in range(2):
        sched.add(i, (100 * (i + 1) + np.arange(8)).astype(np.int32), 12)
    while sched.num_preemptions == 0:
        batch = sched.schedule()
        sched.update(batch, np.full(batch.num_sampled, 5, np.int32))
    hits = sched.num_prefix_hit_tokens
    _run(sched, cfg)
    assert sched.num_prefix_hit_tokens > hits       # readmission found its own blocks
    assert sched.num_free_blocks == 7


def test_eviction_under_pressure_drops_old_prefixes() -> None:
    sched, cfg = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first = np.arange(17, dtype=np.int32)
    sched.add(0, first, 1)
    _run(sched, cfg)
    assert len(sched.prefix_cache.match(first)) == 4
    for i in range(1, 4):                            # new content needs the parked blocks
        sched.add(i, (1000 * i + np.arange(17)).astype(np.int32), 1)
        _run(sched, cfg)
    assert sched.prefix_cache.num_evictions > 0
    assert len(sched.prefix_cache.match(first)) == 0
    assert sched.num_free_blocks == 6


# ---- scheduler property test with a fake KV cache --------------------------------------------

class FakeKV:
    """Slot -> the token prefix whose last token's K/V is stored there (what a forward wrote)."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.kv: dict[int, tuple] = {}

    def forward(self, batch, before: dict[str, Any]) -> None:
        """Copy-on-write copies, write every scheduled token, then check every row reads its
        own prefix (cached blocks included) through its block table."""
        bs, qsl = self.bs, batch.query_start_loc
        for src, dst in zip(batch.copy_src.tolist(), batch.copy_dst.tolist()):
            for j in range(bs):
                if src * bs + j in self.kv:
                    self.kv[dst * bs + j] = self.kv[src * bs + j]
        rows = []
        for b in range(batch.num_seqs):
            toks = before["seqs"][int(batch.seq_ids[b])]["token_ids"].tolist()
            for r in range(int(qsl[b]), int(qsl[b + 1])):
                pos = int(batch.positions[r])
                self.kv[int(batch.slot_mapping[r])] = tuple(toks[:pos + 1])
            rows.append((batch.block_tables[b], int(batch.seq_lens[b]), toks))
        for table, seq_len, toks in rows:
            for pos in range(seq_len):
                slot = int(table[pos // bs]) * bs + pos % bs
                assert self.kv.get(slot) == tuple(toks[:pos + 1]), f"stale KV at {pos}"

    def check_cache(self, sched: Scheduler) -> None:
        """Every cached block holds the KV of its tokens, under the right chained hash."""
        cs, bs = sched.prefix_cache.debug_state(), self.bs
        for b, toks in cs["tokens"].items():
            prefix = self.kv[b * bs + bs - 1]
            assert list(prefix[-bs:]) == toks.tolist() and len(prefix) % bs == 0
            assert cs["hashes"][b] == chain(prefix, bs)[-1]
            assert all(self.kv[b * bs + j] == prefix[:len(prefix) - bs + j + 1]
                       for j in range(bs))


def _context_sampler(batch, before: dict[str, Any]) -> np.ndarray:
    """A deterministic fake model: the next token is a function of the whole context."""
    out = []
    for sid in batch.sample_seq_ids.tolist():
        seq = before["seqs"].get(sid) or before["seqs"][sid // 8 * 8]   # unforked sibling
        toks = seq["token_ids"]
        out.append((int(np.dot(toks, np.arange(1, len(toks) + 1))) + sid) % 12)
    return np.array(out, np.int32)


def _drive(cfg: dict[str, Any], reqs: list, steps_between: list[int]) -> dict[int, list[int]]:
    sched = Scheduler(**cfg)
    kv = FakeKV(cfg["block_size"])
    produced: dict[int, list[int]] = {}

    def one_step() -> None:
        before = sched.debug_state()
        batch = sched.schedule()
        after = sched.debug_state()       # num_computed at admission includes prefix hits
        check_batch_invariants(batch, after, cfg)
        for sid in batch.seq_ids.tolist():
            was, now = before["seqs"][sid]["num_computed"], after["seqs"][sid]["num_computed"]
            assert was == now or (was == 0 and before["seqs"][sid]["status"] == "waiting"
                                  and now % cfg["block_size"] == 0
                                  and now < after["seqs"][sid]["num_tokens"])
        kv.forward(batch, before)
        ids, toks, _ = sched.update(batch, _context_sampler(batch, before))
        for i, t in zip(ids.tolist(), toks.tolist()):
            produced.setdefault(i, []).append(t)
        check_state_invariants(sched, cfg)
        if cfg["enable_prefix_caching"]:
            kv.check_cache(sched)

    for (sid, prompt, max_tokens, n), gap in zip(reqs, steps_between):
        sched.add(sid, prompt, max_tokens, (11,), n)
        for _ in range(gap):
            one_step()
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        one_step()
    state = sched.debug_state()
    assert not sched.has_unfinished() and sched.num_free_blocks == cfg["num_blocks"]
    assert not np.any(state["ref_counts"])
    if cfg["enable_prefix_caching"]:               # no leaks: every block free or parked
        assert sorted(state["evictable"]) == sorted(sched.prefix_cache.debug_state()["hashes"])
        event(f"hits: {sched.num_prefix_hit_tokens > 0}")
        event(f"evictions: {sched.prefix_cache.num_evictions > 0}")
        event(f"preempted: {sched.num_preemptions > 0}")
    return produced


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(6, 16), block_size=st.sampled_from([1, 2, 4]),
       max_num_seqs=st.integers(1, 5), budget=st.integers(4, 40), chunked=st.booleans(),
       seed=st.integers(0, 2**16), num_reqs=st.integers(1, 10))
def test_caching_on_matches_off_and_kv_is_never_stale(
        num_blocks: int, block_size: int, max_num_seqs: int, budget: int, chunked: bool,
        seed: int, num_reqs: int) -> None:
    rng = np.random.default_rng(seed)
    max_len = num_blocks * block_size
    stems = [rng.integers(0, 10, max_len).astype(np.int32) for _ in range(2)]
    reqs = []
    for i in range(num_reqs):
        total = int(rng.integers(2, max_len + 1))
        P = int(rng.integers(1, total))
        shared = int(rng.integers(0, P + 1))
        prompt = np.concatenate([stems[i % 2][:shared], rng.integers(0, 10, P - shared)])
        reqs.append((8 * i, prompt.astype(np.int32), total - P,
                     int(rng.integers(1, min(3, max_num_seqs) + 1))))
    gaps = rng.integers(0, 4, num_reqs).tolist()
    cfg = {"num_blocks": num_blocks, "block_size": block_size, "max_num_seqs": max_num_seqs,
           "max_num_batched_tokens": budget, "max_model_len": max_len,
           "enable_chunked_prefill": chunked}
    off = _drive({**cfg, "enable_prefix_caching": False}, reqs, gaps)
    on = _drive({**cfg, "enable_prefix_caching": True}, reqs, gaps)
    assert on == off


# ---- config, flag, engine --------------------------------------------------------------------

def test_flag_reaches_the_cache_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    # on by default, as in vLLM V1; --no-enable-prefix-caching turns it off
    assert engine_config_from_args(parser.parse_args([])).cache_config.enable_prefix_caching
    cfg = engine_config_from_args(parser.parse_args(["--enable-prefix-caching"]))
    assert cfg.cache_config.enable_prefix_caching is True
    cfg = engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"]))
    assert cfg.cache_config.enable_prefix_caching is False
    assert EngineConfig().cache_config.enable_prefix_caching   # the offline LLM's default


def _shared_prefix_requests(n: int = 32, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(99)]        # 100 shared tokens
    return [(prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))],
             rng.randrange(4, 40)) for _ in range(n)]


def _serve_staggered(enable: bool) -> tuple[dict[str, list[int]], Any, Any]:
    from nybble import SamplingParams
    from nybble.config import DEFAULT_MODEL
    from nybble.runtime.llm_engine import LLMEngine

    # 24 blocks x 16 tokens: about 3 requests' worth; forces eviction and preemption.
    engine = LLMEngine.from_engine_args(DEFAULT_MODEL, max_num_seqs=8, num_gpu_blocks=24,
                                        max_num_batched_tokens=256,
                                        enable_prefix_caching=enable)
    pending = list(enumerate(_shared_prefix_requests()))
    finals: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), 2)):
            i, (prompt, max_tokens) = pending.pop(0)
            engine.add_request(str(i), prompt, SamplingParams(temperature=0,
                                                              max_tokens=max_tokens))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    return finals, engine.get_stats(), engine


@pytest.mark.slow
def test_engine_greedy_outputs_equal_with_caching_on_and_off() -> None:
    off, off_stats, _ = _serve_staggered(False)
    on, on_stats, engine = _serve_staggered(True)
    assert on == off and len(on) == 32
    assert off_stats.num_cached_tokens_total == 0 and off_stats.prefix_cache_hit_rate == 0.0
    assert on_stats.num_cached_tokens_total > 0 and 0 < on_stats.prefix_cache_hit_rate < 1
    assert on_stats.num_preemptions > 0 and engine.scheduler.prefix_cache.num_evictions > 0
    assert on_stats.num_free_blocks == on_stats.num_blocks
    assert not np.any(engine.scheduler.debug_state()["ref_counts"])
    print(f"prefix cache hit rate {on_stats.prefix_cache_hit_rate:.3f} "
          f"({on_stats.num_cached_tokens_total} tokens), preemptions "
          f"{on_stats.num_preemptions} on / {off_stats.num_preemptions} off, evictions "
          f"{engine.scheduler.prefix_cache.num_evictions}")
