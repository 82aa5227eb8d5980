"""The model runner's sampling table: rows added at admission and dropped at finish, values
gathered in batch order, only changed rows uploaded, no leak after finish or abort."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble import SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.runtime.llm_engine import LLMEngine
from nybble.runtime.sample.sampling_table import SamplingTable

CPU = torch.device("cpu")


def _values(table: SamplingTable, seq_ids: list[int]) -> list[tuple]:
    b = table.batch(np.asarray(seq_ids, np.int64))
    return list(zip(b.temperature.tolist(), b.top_p.tolist(), b.top_k.tolist(),
                    b.min_p.tolist()))


@pytest.mark.parametrize("shared", [True, False])
def test_rows_added_gathered_dropped(shared: bool) -> None:
    table = SamplingTable(vocab_size=100, device=CPU, capacity=4, share_host_memory=shared)
    table.add(10, SamplingParams(n=3, temperature=0.5, top_p=0.25, top_k=7, min_p=0.125))
    table.add(13, SamplingParams(temperature=0.0, top_k=1000, logprobs=3))
    assert len(table) == 4 and all(s in table for s in (10, 11, 12, 13))
    assert table.num_pending_uploads == (0 if shared else 4)
    # gathered in the order asked, the same row twice if asked twice
    got = _values(table, [13, 11, 10, 11])
    assert got[0] == (0.0, 1.0, 100, 0.0)          # top_k capped at the vocabulary
    assert got[1] == got[2] == got[3] == (0.5, 0.25, 7, 0.125)
    assert table.num_pending_uploads == 0
    assert table.batch(np.asarray([10, 13], np.int64)).max_logprobs == 3
    assert table.batch(np.asarray([10], np.int64)).max_logprobs == -1
    table.remove([10, 11, 12, 99])                 # unknown ids are ignored
    assert len(table) == 1 and 10 not in table
    # a freed row is reused; the stale values of its previous owner are never read
    table.add(20, SamplingParams(temperature=2.0, top_p=0.5, top_k=-1, min_p=0.0))
    assert table.num_pending_uploads == (0 if shared else 1), "only the new row is uploaded"
    assert _values(table, [20, 13]) == [(2.0, 0.5, -1, 0.0), (0.0, 1.0, 100, 0.0)]
    assert table.capacity == 4


@pytest.mark.parametrize("shared", [True, False])
def test_table_grows_and_keeps_values(shared: bool) -> None:
    table = SamplingTable(vocab_size=50, device=CPU, capacity=2, share_host_memory=shared)
    for i in range(9):
        table.add(i, SamplingParams(temperature=0.1 * i, top_k=i + 1))
    assert table.capacity >= 9 and len(table) == 9
    b = table.batch(np.arange(9, dtype=np.int64))
    assert b.top_k.tolist() == list(range(1, 10))
    assert torch.equal(b.temperature, torch.tensor([0.1 * i for i in range(9)],
                                                   dtype=torch.float32))
    with pytest.raises(ValueError):
        table.add(8, SamplingParams())
    assert len(table) == 9


def test_seeded_rows_get_their_own_generators() -> None:
    table = SamplingTable(vocab_size=50, device=CPU)
    table.add(0, SamplingParams(n=3, seed=42, temperature=1.0))
    table.add(3, SamplingParams(seed=42, temperature=0.0))     # greedy: the seed is unused
    table.add(4, SamplingParams(temperature=1.0))
    gens = table.batch(np.arange(5, dtype=np.int64)).generators
    assert gens[3] is None and gens[4] is None
    for i in range(3):
        want = torch.empty(8).exponential_(
            generator=torch.Generator().manual_seed(42 + i * 1_000_003))
        assert torch.equal(torch.empty(8).exponential_(generator=gens[i]), want)
    table.remove(range(5))
    assert table.batch(np.zeros(0, np.int64)).generators == []


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_engine_args(DEFAULT_MODEL, max_num_seqs=8)


def _drain(engine: LLMEngine) -> dict[str, list[list[int]]]:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [o.token_ids for o in out.outputs]
    return finals


def test_no_rows_leak_after_finish_stop_string_or_abort(engine: LLMEngine) -> None:
    table = engine.engine_core.runner.sampling
    engine.add_request("len", "Once upon a time", SamplingParams(n=2, seed=1, max_tokens=5))
    engine.add_request("stop", "The dog", SamplingParams(temperature=0, stop=["."],
                                                         max_tokens=100))
    engine.add_request("abort", "Tom and Sue", SamplingParams(n=3, max_tokens=50))
    engine.add_request("waiting", "Lily", SamplingParams(max_tokens=50))
    assert len(table) == 2 + 1 + 3 + 1
    engine.step()
    engine.abort_request(["abort", "waiting"])
    assert len(table) == 3
    _drain(engine)
    assert len(table) == 0


def test_sample_i_is_seeded_as_its_own_request(engine: LLMEngine) -> None:
    """Sample i of a request with ``seed`` draws exactly what a lone request seeded
    ``seed + i * 1_000_003`` draws, whatever else shares the batches."""
    params = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 24, "ignore_eos": True}
    crowd = {f"c{i}": SamplingParams(temperature=0.7, max_tokens=5 + 3 * i, seed=None)
             for i in range(4)}
    for rid, p in crowd.items():
        engine.add_request(rid, "One day", p)
    engine.add_request("group", "Once upon a time", SamplingParams(n=3, seed=99, **params))
    group = _drain(engine)["group"]
    for i in range(3):
        engine.add_request(f"alone{i}", "Once upon a time",
                           SamplingParams(seed=99 + i * 1_000_003, **params))
        assert _drain(engine)[f"alone{i}"] == [group[i]]
