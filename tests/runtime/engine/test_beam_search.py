"""Beam search: the beams equal transformers' ``generate(num_beams=k, do_sample=False,
length_penalty=..., early_stopping=...)`` on the bundled model (best beam token for token,
every returned beam and its score), beams share KV blocks by fork and free pruned ones at
once, all beams of all requests run in one forward per step, and nothing leaks."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from nybble import LLM, BeamSearchParams, SamplingParams
from nybble.config import DEFAULT_MODEL
from nybble.outputs import RequestOutput
from nybble.runtime.llm_engine import LLMEngine

from tests.runtime.engine_helpers import assert_idle_and_clean, make_engine

PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog", "One day, a big"]
HF_EOS = [2, 1]    # the bundled model's generation_config.json eos_token_id


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEFAULT_MODEL, dtype="float32", num_gpu_blocks=512, block_size=16)


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
         ) -> dict[str, RequestOutput]:
    """Add ``requests`` (id -> prompt ids, params), step until idle; the final outputs."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def hf_beams(hf: torch.nn.Module, ids: list[int], k: int, max_tokens: int, length_penalty: float,
             early_stopping: bool | str, eos: list[int] = HF_EOS) -> tuple[list[list[int]],
                                                                       list[float]]:
    """transformers' ``k`` returned beams (generated ids, padding cut) and their scores."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k,
                          do_sample=False, length_penalty=length_penalty,
                          early_stopping=early_stopping, max_new_tokens=max_tokens,
                          eos_token_id=eos, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    beams = []
    for row in out.sequences[:, len(ids):].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        beams.append(row[:ends[0] + 1] if ends else row)
    return beams, out.sequences_scores.tolist()


def check_against_hf(ours: list[list[int]], scores: list[float], ref: list[list[int]],
                     ref_scores: list[float]) -> None:
    assert ours[0] == ref[0], "best beam differs from transformers"
    assert ours == ref
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty,early_stopping", [
    (1.0, False), (0.0, True), (2.0, "never"), (-0.5, False)])
def test_beams_equal_transformers(llm: LLM, hf: torch.nn.Module, k: int, length_penalty: float,
                                  early_stopping: bool | str) -> None:
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.beam_search(ids, BeamSearchParams(beam_width=k, max_tokens=24,
                                                 length_penalty=length_penalty,
                                                 early_stopping=early_stopping))
    for prompt_ids, out in zip(ids, outs):
        assert len(out.sequences) == k
        ours = [s.tokens[len(prompt_ids):] for s in out.sequences]
        assert all(s.tokens[:len(prompt_ids)] == prompt_ids for s in out.sequences)
        ref, ref_scores = hf_beams(hf, prompt_ids, k, 24, length_penalty, early_stopping)
        check_against_hf(ours, [s.score for s in out.sequences], ref, ref_scores)
        for s in out.sequences:   # the score is the cumulative logprob over generated_len**lp
            n = len(s.tokens) - len(prompt_ids)
            assert s.score == pytest.approx(s.cum_logprob / n ** length_penalty, rel=1e-6)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length_penalty,early_stopping", [
    (1.0, False), (1.0, True), (0.0, False), (2.0, "never"), (0.5, "never")])
def test_stop_token_ends_beams_like_eos(llm: LLM, hf: torch.nn.Module, k: int,
                                        length_penalty: float,
                                        early_stopping: bool | str) -> None:
    """A frequent stop token (".") makes beams finish early: the finished-hypothesis,
    length-penalty and early-stopping paths, against transformers with "." as one more EOS."""
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    period = tok.encode("a.")[-1]
    assert tok.decode([period]) == "."
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        rid = f"stop-{k}-{length_penalty}-{early_stopping}-{i}"
        final = _run(engine, {rid: (ids, SamplingParams(
            n=k, use_beam_search=True, temperature=0.0, max_tokens=40,
            stop_token_ids=[period], length_penalty=length_penalty,
            early_stopping=early_stopping))})[rid]
        ref, ref_scores = hf_beams(hf, ids, k, 40, length_penalty, early_stopping,
                                   eos=HF_EOS + [period])
        ours = [o.token_ids for o in final.outputs]
        scores = [o.cumulative_logprob / len(o.token_ids) ** length_penalty
                  for o in final.outputs]
        check_against_hf(ours, scores, ref, ref_scores)
        for o in final.outputs:
            ended = o.token_ids[-1] == period
            assert o.finish_reason == ("stop" if ended else "length")
            assert o.stop_reason == (period if ended else None)
        assert any(o.finish_reason == "stop" for o in final.outputs)
    assert_idle_and_clean(engine)


def test_model_eos_ends_a_beam(llm: LLM, hf: torch.nn.Module) -> None:
    """A story that ends: the model's own EOS finishes the best beam (k = 4, 200 tokens)."""
    ids = llm.get_tokenizer().encode("They were happy. The end.")
    out = llm.beam_search([ids], BeamSearchParams(beam_width=4, max_tokens=200,
                                                  length_penalty=0.0, early_stopping=True))[0]
    best = out.sequences[0]
    assert best.finish_reason == "stop" and best.tokens[-1] in HF_EOS
    ref, ref_scores = hf_beams(hf, ids, 4, 200, 0.0, True)
    check_against_hf([s.tokens[len(ids):] for s in out.sequences],
                     [s.score for s in out.sequences], ref, ref_scores)
    assert "<" not in best.text   # EOS is a special token: not in the text


def _tokens(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
            ) -> dict[str, list[list[int]]]:
    return {rid: [o.token_ids for o in out.outputs]
            for rid, out in _run(engine, requests).items()}


def beam(k: int, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(n=k, use_beam_search=True, temperature=0.0, max_tokens=max_tokens)


def test_beams_fork_blocks_and_free_pruned_beams_at_once() -> None:
    """After every step, each KV block's ref count is the number of live beams whose block
    table holds it (prefix caching off): the prompt's blocks are shared by every beam, forks
    share their parent's blocks, and a pruned beam holds nothing any more."""
    engine = make_engine(block_size=8, num_gpu_blocks=128)
    ids = engine.tokenizer.encode("Once upon a time there was a little girl named")
    engine.add_request("b", ids, beam(4, 32))
    core = engine.engine_core
    group = set(core.beams.live_seq_ids("b"))
    seen_prompt_shared = seen_fork = seen_prune = False
    prev: set[int] = set()
    while engine.has_unfinished_requests():
        engine.step()
        if "b" not in core.beams.requests:
            break
        live = set(core.beams.live_seq_ids("b"))
        state = engine.scheduler.debug_state()
        assert set(state["seqs"]) == live, "a pruned beam is still in the scheduler"
        counts = Counter(int(b) for s in live for b in state["seqs"][s]["block_ids"])
        ref = state["ref_counts"]
        assert {int(b): int(ref[b]) for b in np.flatnonzero(ref)} == dict(counts)
        first = state["seqs"][min(live)]["block_ids"][0]
        seen_prompt_shared |= counts[int(first)] == 4
        seen_fork |= bool(live - group - prev)
        seen_prune |= bool(prev - live)
        prev = live
        assert len(live) == 4 and len(engine.engine_core.runner.sampling) == 4
    assert seen_prompt_shared and seen_fork and seen_prune
    assert_idle_and_clean(engine)


def test_all_beams_of_all_requests_run_in_one_forward() -> None:
    """Two beam searches and two greedy requests together: each gives what it gives alone,
    and one step (one forward) holds every live beam of both searches plus the greedy rows."""
    engine = make_engine(num_gpu_blocks=256)
    tok = engine.tokenizer
    reqs = {"b4": (tok.encode("Once upon a time"), beam(4)),
            "b2": (tok.encode("The little dog"), beam(2)),
            "g1": (tok.encode("Lily wanted to"), SamplingParams(temperature=0, max_tokens=24)),
            "g2": (tok.encode("One day"), SamplingParams(temperature=0, max_tokens=24))}
    alone = {rid: _tokens(make_engine(num_gpu_blocks=256), {rid: r})[rid]
             for rid, r in reqs.items()}
    steps0 = engine.get_stats().num_steps
    together = _tokens(engine, reqs)
    assert together == alone
    stats = engine.get_stats()
    assert stats.peak_num_seqs_in_step == 4 + 2 + 1 + 1
    assert stats.num_steps - steps0 == 24      # one step per generated token, for all
    assert_idle_and_clean(engine)


def test_preempted_beams_wait_for_each_other() -> None:
    """A pool too small for everything: forked beams get preempted, the others decline their
    tokens until the whole beam set is sampled in one step; the result is unchanged."""
    tok_ids = make_engine(num_gpu_blocks=64).tokenizer.encode("Once upon a time")
    alone = _tokens(make_engine(block_size=8, num_gpu_blocks=128), {"b": (tok_ids, beam(4))})
    engine = make_engine(block_size=8, num_gpu_blocks=16, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    got = _tokens(engine, {"b": (tok_ids, beam(4)), "g1": (tok_ids, greedy),
                        "g2": (tok_ids[:3], greedy)})
    assert got["b"] == alone["b"]
    assert engine.get_stats().num_preemptions > 0
    assert engine.engine_core.beams.num_declined > 0
    assert_idle_and_clean(engine)


def test_abort_frees_every_beam() -> None:
    engine = make_engine(block_size=8, num_gpu_blocks=128)
    engine.add_request("b", engine.tokenizer.encode("Once upon a time"), beam(4, 40))
    for _ in range(6):
        engine.step()
    assert len(engine.engine_core.beams.live_seq_ids("b")) == 4
    engine.abort_request("b")
    assert_idle_and_clean(engine)
    assert not engine.engine_core.beams.owner


def test_max_tokens_one_and_n_below_width() -> None:
    engine = make_engine()
    ids = engine.tokenizer.encode("Once upon a time")
    params = SamplingParams(n=2, beam_width=4, use_beam_search=True, temperature=0.0,
                            max_tokens=1)
    out = _tokens(engine, {"a": (ids, params)})["a"]
    assert len(out) == 2 and all(len(t) == 1 for t in out)
    assert_idle_and_clean(engine)


def test_prefix_caching_keeps_beams_and_pool_clean() -> None:
    """With prefix caching on, a repeated beam search hits the cache, gives the same beams,
    and every block is free (parked) afterwards."""
    engine = make_engine(block_size=8, num_gpu_blocks=128, enable_prefix_caching=True)
    ids = engine.tokenizer.encode("Once upon a time there was a little girl named Lily. She")
    first = _tokens(engine, {"a": (ids, beam(4, 20))})["a"]
    again = _tokens(engine, {"b": (ids, beam(4, 20))})["b"]
    assert again == first
    assert engine.scheduler.num_prefix_hit_tokens > 0
    assert_idle_and_clean(engine)
    fresh = _tokens(make_engine(block_size=8, num_gpu_blocks=128),
                    {"c": (ids, beam(4, 20))})["c"]
    assert fresh == first
