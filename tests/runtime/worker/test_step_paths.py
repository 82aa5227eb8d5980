"""The other ways a step's forward can run give the eager forward's results: the padded
decode-graph path (eagerly on the CPU; CUDA graphs on a GPU), and torch.compile'd segments."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.runtime.worker.cuda_graphs import DecodeGraphs, capture_sizes
from nybble.runtime.llm_engine import LLMEngine
from nybble.runtime.worker.step_inputs import StepInputs

PROMPTS = ["Once upon a time", "Tom and Sue", "The dog", "Lily wanted to"]


def test_capture_sizes() -> None:
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-1] == 512
    assert capture_sizes(16, (4, 12, 40)) == [4, 12]


def _decode_batch(engine: LLMEngine, num_seqs: int):
    """Admit ``num_seqs`` prompts, step until all decode; return the next (decode) batch."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", PROMPTS[i], params)
    for _ in range(3):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.max_query_len == 1 and batch.num_seqs == num_seqs
    return batch


@pytest.mark.parametrize("num_seqs,bucket", [(3, 4), (1, 2)])
def test_padded_decode_path_matches_eager(num_seqs: int, bucket: int) -> None:
    """A decode batch padded to its bucket gives the eager hidden states, and the padding
    rows write no KV slot."""
    engine = LLMEngine.from_engine_args(DEFAULT_MODEL, max_num_seqs=8, num_gpu_blocks=64)
    runner = engine.engine_core.runner
    batch = _decode_batch(engine, num_seqs)
    with torch.inference_mode():
        ids, pos, meta = runner.prepare(batch)
        eager = runner.model(ids, pos, runner.kv_caches, meta).clone()
        before = [c.clone() for c in runner.kv_caches]
        inputs = StepInputs(runner.device, 64, 8, batch.block_tables.shape[1], copy=True)
        graphs = DecodeGraphs(runner.model, runner.kv_caches, [2, 4, 8], inputs,
                              engine.max_model_len, capture=False)
        assert graphs.can_run(batch) and graphs._bucket(num_seqs) == bucket
        padded = graphs.run(batch)
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    written = np.zeros(runner.kv_caches[0].shape[1] * runner.kv_caches[0].shape[2], bool)
    written[batch.slot_mapping] = True
    for old, new in zip(before, runner.kv_caches):
        flat_old, flat_new = old.flatten(1, 2), new.flatten(1, 2)
        assert torch.equal(flat_old[:, ~written], flat_new[:, ~written])
        torch.testing.assert_close(flat_new[:, written], flat_old[:, written])


def _greedy(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
def test_compiled_segments_match_eager() -> None:
    """compilation_level 3 (inductor) generates the eager tokens, and its hidden states
    equal the eager ones to float32 rounding."""
    eager = LLM(DEFAULT_MODEL, max_num_seqs=4)
    compiled = LLM(DEFAULT_MODEL, max_num_seqs=4, compilation_level=3)
    assert compiled.llm_engine.engine_core.runner.model.segments[0] is not \
        eager.llm_engine.engine_core.runner.model.segments[0]
    assert _greedy(compiled) == _greedy(eager)


@pytest.mark.gpu
def test_cuda_graphs_match_eager() -> None:
    """Decode steps replayed from CUDA graphs generate the eager tokens; a batch larger than
    the largest bucket runs eagerly."""
    common = {"device": "cuda", "dtype": "float32", "max_num_seqs": 4}
    eager = LLM(DEFAULT_MODEL, enforce_eager=True, **common)
    graphs = LLM(DEFAULT_MODEL, **common)
    small = LLM(DEFAULT_MODEL, cuda_graph_sizes=(1, 2), **common)
    assert eager.llm_engine.engine_core.runner.graphs is None
    assert graphs.llm_engine.engine_core.runner.graphs.sizes == [1, 2, 4]
    want = _greedy(eager)
    assert _greedy(graphs) == want
    assert _greedy(small) == want
