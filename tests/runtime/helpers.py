"""Scheduler test helpers: build schedulers and requests, drive steps, check every invariant,
and compare the Cython scheduler with the plain-Python reference (the oracle).

Everything goes through the public API plus ``debug_state()`` (no reaching into C state).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from nybble.runtime.scheduler.scheduler import Scheduler

from nybble.runtime.scheduler.batch import ScheduledBatch
from nybble.runtime.scheduler.reference_scheduler import ReferenceScheduler
from nybble.runtime.scheduler.scheduler_input import window_blocks

IMPLS = {"cython": Scheduler, "reference": ReferenceScheduler}

DEFAULTS: dict[str, Any] = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 8,
                             "max_num_batched_tokens": 32, "max_model_len": 128,
                             "enable_chunked_prefill": True}


def make_scheduler(impl: type = Scheduler, **overrides: Any) -> tuple[Scheduler, dict[str, Any]]:
    """A scheduler (``impl``: Scheduler or ReferenceScheduler) with small test defaults;
    returns it and the full config dict."""
    cfg = {**DEFAULTS, **overrides}
    return impl(**cfg), cfg


@dataclass(frozen=True)
class Req:
    """One test request: ``seq_id``, prompt ``token_ids``, ``max_tokens`` (tokens)."""

    seq_id: int
    token_ids: np.ndarray
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    num_samples: int = 1


def make_requests(num: int, prompt_len: int | list[int] = 8, max_tokens: int = 4,
                  start_id: int = 0, id_stride: int = 1, stop_token_ids: tuple[int, ...] = (),
                  num_samples: int = 1) -> list[Req]:
    """``num`` requests with recognisable prompts (token = 1000 * index + position)."""
    lens = prompt_len if isinstance(prompt_len, list) else [prompt_len] * num
    return [Req(start_id + i * id_stride,
                (1000 * (i + 1) + np.arange(lens[i])).astype(np.int32), max_tokens,
                stop_token_ids, num_samples) for i in range(num)]


def add_all(sched: Scheduler, reqs: list[Req]) -> None:
    """Add every request in order."""
    for r in reqs:
        sched.add(r.seq_id, r.token_ids, r.max_tokens, r.stop_token_ids, r.num_samples)


def check_state_invariants(sched: Scheduler, cfg: dict[str, Any]) -> dict[str, Any]:
    """Block ownership and queue invariants of a scheduler at rest; returns debug_state().

    A block with ref count r is held by exactly r live sequences; the free list holds exactly
    the blocks with ref count 0, once each; waiting sequences hold no blocks; running
    sequences hold blocks for at least their computed tokens; the seq cap holds. With a
    sliding window, the null block (ref count 0, never free) is only the leading entries of
    tables, and no table holds more real blocks than ``window_blocks`` (the fit rule's bound).
    """
    st = sched.debug_state()
    ref, free, null = st["ref_counts"], st["free_list"], st["null_block"]
    holders: Counter[int] = Counter()
    for seq in st["seqs"].values():
        ids = seq["block_ids"]
        num_null = int(np.count_nonzero(ids == null)) if null >= 0 else 0
        assert np.all(ids[:num_null] == null), "null block past a table's leading entries"
        ids = ids[num_null:]
        if cfg.get("sliding_window"):
            assert len(ids) <= window_blocks(cfg["sliding_window"],
                                             cfg["max_num_batched_tokens"], cfg["block_size"])
        holders.update(int(b) for b in ids)
        assert len(set(ids.tolist())) == len(ids), "block twice in a table"
        if seq["status"] == "waiting":
            assert len(seq["block_ids"]) == 0 and seq["num_computed"] == 0
        else:
            assert len(seq["block_ids"]) * cfg["block_size"] >= seq["num_computed"]
        assert seq["num_computed"] <= seq["num_tokens"] <= max(cfg["max_model_len"],
                                                               seq["num_prompt_tokens"] + 1)
    cache = getattr(sched, "prefix_cache", None)
    if null >= 0 and cache is not None and hasattr(cache, "prefix_of"):   # the reference's
        assert null not in cache.prefix_of, "the null block was prefix-cached"
    for b in range(cfg["num_blocks"]):
        assert ref[b] == holders.get(b, 0), f"block {b}: ref {ref[b]} vs {holders.get(b, 0)} holders"
    assert sorted(free.tolist()) == sorted(b for b in np.flatnonzero(ref == 0).tolist()
                                           if b != null), "free list drift"
    assert len(free) == sched.num_free_blocks
    assert st["running_weight"] <= cfg["max_num_seqs"]
    assert set(st["running"]) | set(st["waiting"]) == set(st["seqs"])
    assert len(st["running"]) + len(st["waiting"]) == len(st["seqs"])
    return st


def check_batch_invariants(batch: ScheduledBatch, before: dict[str, Any],
                           cfg: dict[str, Any]) -> None:
    """Check one ScheduledBatch against the debug_state() taken just before schedule().

    slot_mapping matches block_tables and positions; positions continue each sequence's
    computed tokens; query_start_loc is cumulative; seq_lens = previous computed + new; the
    token budget and seq cap hold; a row is sampled iff it completes its tokens.
    """
    B, T, bs = batch.num_seqs, batch.num_tokens, cfg["block_size"]
    mb = -(-cfg["max_model_len"] // bs)
    assert T <= cfg["max_num_batched_tokens"] and B <= cfg["max_num_seqs"]
    assert batch.input_ids.shape == batch.positions.shape == batch.slot_mapping.shape == (T,)
    assert batch.block_tables.shape == (B, mb) and batch.query_start_loc.shape == (B + 1,)
    assert batch.seq_lens.shape == batch.seq_ids.shape == (B,)
    assert batch.input_ids.dtype == np.int32 and batch.positions.dtype == np.int64
    assert batch.slot_mapping.dtype == np.int64 and batch.block_tables.dtype == np.int32
    assert len(set(batch.seq_ids.tolist())) == B
    qsl = batch.query_start_loc
    assert qsl[0] == 0 and qsl[-1] == T and np.all(np.diff(qsl) >= 1)
    expected_samples: list[tuple[int, int]] = []
    for b in range(B):
        seq = before["seqs"][int(batch.seq_ids[b])]
        start, n = seq["num_computed"], int(qsl[b + 1] - qsl[b])
        assert batch.seq_lens[b] == start + n <= seq["num_tokens"]
        pos = np.arange(start, start + n)
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        assert np.array_equal(batch.positions[rows], pos)
        assert np.array_equal(batch.input_ids[rows], seq["token_ids"][start:start + n])
        table = batch.block_tables[b]
        nblk = -(-(start + n) // bs)
        assert np.all(table[:nblk] >= 0) and np.all(table[nblk:] == -1)
        assert np.array_equal(batch.slot_mapping[rows], table[pos // bs] * bs + pos % bs)
        if start + n == seq["num_tokens"]:
            expected_samples += [(int(qsl[b + 1]) - 1, int(batch.seq_ids[b]) + i)
                                 for i in range(seq["num_samples"])]
    got = list(zip(batch.sample_rows.tolist(), batch.sample_seq_ids.tolist()))
    assert got == expected_samples
    assert batch.max_query_len == (int(np.diff(qsl).max()) if B else 0)
    assert batch.max_seq_len == (int(batch.seq_lens.max()) if B else 0)
    assert batch.copy_src.shape == batch.copy_dst.shape
    assert len(set(batch.copy_dst.tolist())) == len(batch.copy_dst)
    # A written slot belongs to exactly one row: no two rows write the same KV slot.
    assert len(set(batch.slot_mapping.tolist())) == T


Sampler = Callable[[ScheduledBatch], np.ndarray]


def constant_sampler(token: int = 7) -> Sampler:
    """Fake model: every sampled row yields ``token``."""
    return lambda batch: np.full(batch.num_sampled, token, np.int32)


def step(sched: Scheduler, cfg: dict[str, Any], sampler: Sampler
         ) -> tuple[ScheduledBatch, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """schedule -> invariant checks -> update(fake tokens) -> state checks."""
    before = sched.debug_state()
    batch = sched.schedule()
    check_batch_invariants(batch, before, cfg)
    check_state_invariants(sched, cfg)
    out = sched.update(batch, sampler(batch))
    check_state_invariants(sched, cfg)
    return batch, out


def run_to_completion(sched: Scheduler, cfg: dict[str, Any], sampler: Sampler,
                      max_steps: int = 10_000) -> dict[int, list[int]]:
    """Step until nothing is left; return seq_id -> tokens it generated (last has finish)."""
    tokens: dict[int, list[int]] = {}
    finished: dict[int, int] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        _, (ids, toks, fin) = step(sched, cfg, sampler)
        for i, t, f in zip(ids.tolist(), toks.tolist(), fin.tolist()):
            assert i not in finished, f"seq {i} produced a token after finishing"
            tokens.setdefault(i, []).append(t)
            if f:
                finished[i] = f
    assert not sched.has_unfinished(), "did not finish within max_steps"
    assert sched.num_free_blocks == cfg["num_blocks"] - (sched.null_block >= 0)
    assert not np.any(sched.debug_state()["ref_counts"])
    return tokens


COUNTERS = ("num_running", "num_waiting", "num_preemptions", "num_free_blocks",
            "num_prefix_hit_tokens", "num_prefix_query_tokens", "num_window_freed_blocks",
            "null_block", "sliding_window")


def assert_same_batch(got: ScheduledBatch, want: ScheduledBatch) -> None:
    """Every field of two ScheduledBatches is equal (arrays: same dtype, shape and values)."""
    for f in fields(ScheduledBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a, b)
            assert np.array_equal(a, b), (f.name, a, b)
        else:
            assert a == b, (f.name, a, b)


def step_both(cy: Any, ref: Any, sampler: Callable[[ScheduledBatch], np.ndarray]
              ) -> ScheduledBatch:
    """One step of two schedulers in lockstep: equal batches, the same ``sampler(batch)``
    tokens given to both, equal ``update`` results. Returns the Cython batch."""
    batch, ref_batch = cy.schedule(), ref.schedule()
    assert_same_batch(batch, ref_batch)
    sampled = sampler(batch)
    for a, b in zip(cy.update(batch, sampled), ref.update(ref_batch, sampled)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    return batch


def assert_same_state(got: Any, want: Any) -> None:
    """Counters, block pool (ref counts, free list order, parked LRU), queues and every
    sequence of two schedulers are equal. ``max_tokens`` is left out: the Cython core keeps
    min(max_tokens, token capacity), which finishes at the same token."""
    assert {c: getattr(got, c) for c in COUNTERS} == {c: getattr(want, c) for c in COUNTERS}
    a, b = got.debug_state(), want.debug_state()
    for key in ("ref_counts", "free_list"):
        assert np.array_equal(a[key], b[key]), (key, a[key], b[key])
    for key in ("evictable", "running", "waiting", "running_weight"):
        assert a[key] == b[key], (key, a[key], b[key])
    assert a["seqs"].keys() == b["seqs"].keys()
    for sid, seq in b["seqs"].items():
        for key, value in seq.items():
            if key != "max_tokens":
                assert np.array_equal(a["seqs"][sid][key], value), (sid, key)
    if want.prefix_cache is not None:
        for key in ("num_cached_blocks", "num_evictable_blocks", "num_evictions"):
            assert getattr(got.prefix_cache, key) == getattr(want.prefix_cache, key), key
