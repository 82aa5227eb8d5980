"""Speculative decoding in the Cython scheduler: lookahead slots, n-gram proposals, and
``update_spec`` (variable tokens per row, rejected drafts' blocks released), no model."""
from __future__ import annotations

import numpy as np
import pytest
from nybble.runtime.scheduler.ngram import propose_ngram
from nybble.runtime.scheduler.scheduler import Scheduler
from nybble.runtime.scheduler.sequence import FinishReason

from tests.runtime.helpers import check_state_invariants


def _ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup written plainly: longest suffix n-gram first, most recent match."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_examples() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2], 1, 3, 3).tolist() == [3, 4, 1]
    assert propose_ngram([1, 2, 3, 4, 1, 2], 1, 3, 1).tolist() == [3]
    assert propose_ngram([1, 2, 3], 1, 3, 3).tolist() == []              # nothing recurs
    assert propose_ngram([5, 9, 5], 1, 1, 4).tolist() == [9, 5]          # cut at the end
    assert propose_ngram([7, 1, 2, 8, 2, 1, 2], 2, 2, 2).tolist() == [8, 2]  # "1 2" -> 8 2
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], 0, 2, 1)


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(200):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 3)), int(rng.integers(1, 6))
        assert propose_ngram(toks, lo, hi, k).tolist() == _ngram_reference(toks, lo, hi, k)


def _cfg(**kw: int) -> dict[str, int]:
    cfg = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 8,
           "max_num_batched_tokens": 64, "max_model_len": 64}
    cfg.update(kw)
    return cfg


def _sched(cfg: dict[str, int], k: int, **kw: int) -> Scheduler:
    return Scheduler(cfg["num_blocks"], cfg["block_size"], cfg["max_num_seqs"],
                     cfg["max_num_batched_tokens"], cfg["max_model_len"],
                     num_lookahead_slots=k, **kw)


def test_lookahead_rows_are_verified_positions() -> None:
    cfg = _cfg()
    s = _sched(cfg, 3, ngram_min=1, ngram_max=3)
    s.add(0, np.array([5, 6, 7, 8, 5, 6], np.int32), 20)
    b = s.schedule()
    assert b.num_draft_tokens.tolist() == [0] and b.sample_rows.tolist() == [5]   # prefill
    s.update(b, np.array([7], np.int32))
    b = s.schedule()                       # last token 7 at 6; "6 7" -> 8 5 6 proposed
    assert b.input_ids.tolist() == [7, 8, 5, 6] and b.positions.tolist() == [6, 7, 8, 9]
    assert b.num_draft_tokens.tolist() == [3] and b.sample_rows.tolist() == [3]
    assert b.seq_lens.tolist() == [10] and s.seq_block_ids(0).tolist() == [0, 1, 2]
    ids, tokens, finish, index = s.update_spec(b, np.array([[8, 5, 9, 0]], np.int32),
                                               np.array([3], np.int32))
    assert tokens.tolist() == [8, 5, 9] and index.tolist() == [0, 1, 2]
    assert finish.tolist() == [0, 0, 0] and ids.tolist() == [0, 0, 0]
    seq = s.debug_state()["seqs"][0]
    assert seq["num_tokens"] == 10 and seq["num_computed"] == 9
    assert seq["token_ids"].tolist() == [5, 6, 7, 8, 5, 6, 7, 8, 5, 9]


def test_rejected_drafts_release_their_blocks() -> None:
    cfg = _cfg()
    s = _sched(cfg, 6)                     # draft-model mode: 6 slots, drafts filled later
    s.add(0, np.arange(1, 8, dtype=np.int32), 30)     # 7 prompt tokens: blocks 0, 1
    s.update(s.schedule(), np.array([9], np.int32))
    b = s.schedule()                       # last token at 7, drafts at 8..13: blocks 0..3
    assert b.num_draft_tokens.tolist() == [6] and len(s.seq_block_ids(0)) == 4
    free = s.num_free_blocks
    s.update_spec(b, np.array([[b.input_ids[1], 4, 0, 0, 0, 0, 0]], np.int32),
                  np.array([2], np.int32))
    # 10 tokens now (9 computed): blocks covering 10 tokens stay, the 4th is released
    assert len(s.seq_block_ids(0)) == 3 and s.num_free_blocks == free + 1
    check_state_invariants(s, cfg)


def test_draft_count_respects_max_tokens_model_len_and_budget() -> None:
    cfg = _cfg(max_model_len=12, max_num_batched_tokens=64)
    s = _sched(cfg, 5)
    s.add(0, np.arange(1, 5, dtype=np.int32), 3)      # 3 new tokens at most
    s.add(1, np.arange(1, 8, dtype=np.int32), 50)     # capped by max_model_len 12
    s.update(s.schedule(), np.array([9, 9], np.int32))
    b = s.schedule()
    # seq 0: 1 generated, 2 left -> 1 draft; seq 1: 8 tokens, positions < 12 -> 4 drafts
    assert b.num_draft_tokens.tolist() == [1, 4]
    s2 = _sched(_cfg(max_num_batched_tokens=3), 5)
    s2.add(0, np.arange(1, 3, dtype=np.int32), 30)
    s2.update(s2.schedule(), np.array([9], np.int32))
    assert s2.schedule().num_draft_tokens.tolist() == [2]     # budget 3 = 1 + 2 drafts


@pytest.mark.parametrize("seed", range(6))
def test_random_speculative_runs_keep_the_pool_consistent(seed: int) -> None:
    """Random acceptance, stops and preemption: every appended token is what the verifier
    emitted (cut at a stop id or max_tokens), no sequence holds a block past its tokens, and
    every block is free at the end."""
    rng = np.random.default_rng(seed)
    cfg = _cfg(num_blocks=int(rng.integers(14, 40)), max_num_seqs=6,
               max_num_batched_tokens=int(rng.integers(8, 40)))
    k = int(rng.integers(1, 5))
    ngram = {"ngram_min": 1, "ngram_max": 2} if seed % 2 else {}
    s = _sched(cfg, k, **ngram)
    want: dict[int, list[int]] = {}
    limit: dict[int, int] = {}
    for i in range(10):
        prompt = rng.integers(3, 8, size=int(rng.integers(1, 12))).astype(np.int32)
        limit[i] = int(rng.integers(1, 25))
        s.add(i, prompt, limit[i], np.array([2], np.int32))
        want[i] = []
    got: dict[int, list[int]] = {i: [] for i in want}
    finished: dict[int, int] = {}
    while s.has_unfinished():
        b = s.schedule()
        m = b.num_draft_tokens
        S, W = len(m), k + 1
        sampled = rng.integers(2, 8, size=(S, W)).astype(np.int32)
        counts = np.ones(S, np.int32)
        for r in range(S):
            drafts = b.input_ids[b.sample_rows[r] - m[r] + 1:b.sample_rows[r] + 1]
            a = int(rng.integers(0, m[r] + 1))
            sampled[r, :a] = drafts[:a]
            counts[r] = a + 1
            emitted = sampled[r, :a + 1].tolist()
            sid = int(b.sample_seq_ids[r])
            for t in emitted:
                want[sid].append(t)
                if t == 2 or len(want[sid]) == limit[sid]:
                    break
        ids, tokens, finish, index = s.update_spec(b, sampled, counts)
        for sid, tok, fin, ix in zip(ids.tolist(), tokens.tolist(), finish.tolist(),
                                     index.tolist()):
            assert sampled.reshape(-1)[ix] == tok
            got[sid].append(tok)
            if fin:
                finished[sid] = fin
        st = check_state_invariants(s, cfg)
        for seq in st["seqs"].values():
            assert len(seq["block_ids"]) <= -(-seq["num_tokens"] // cfg["block_size"])
    assert got == want
    for sid, toks in got.items():
        assert len(toks) <= limit[sid]
        assert finished[sid] == (FinishReason.STOPPED if toks[-1] == 2 else FinishReason.LENGTH)
    assert s.num_free_blocks == cfg["num_blocks"]


def test_update_spec_checks_counts() -> None:
    s = _sched(_cfg(), 2)
    s.add(0, np.arange(1, 5, dtype=np.int32), 10)
    s.update(s.schedule(), np.array([9], np.int32))
    b = s.schedule()
    with pytest.raises(ValueError, match="counts"):
        s.update_spec(b, np.zeros((1, 3), np.int32), np.array([4], np.int32))
    with pytest.raises(ValueError, match="must be passed to update_spec"):
        s.update(b, np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="num_lookahead_slots"):
        Scheduler(8, 4, 2, 16, 32, num_lookahead_slots=2, ngram_min=3, ngram_max=2)
