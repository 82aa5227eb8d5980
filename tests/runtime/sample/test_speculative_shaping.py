"""Speculative decoding with ``min_tokens`` and logit shaping, end to end: stories3m verified
with the bundled stories260k draft and with n-gram proposals (batched, preemption and prefix
caching on) emits token for token what the same engine emits without speculation, in a batch
where only some requests shape; nothing leaks."""
from __future__ import annotations

import pytest

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL
from tests.runtime.engine_helpers import assert_idle_and_clean
from tests.runtime.test_speculative import PROMPTS, baseline, spec_llm  # noqa: F401 (fixtures)

DOT, COMMA = 426, 432      # "." and "," in the stories tokenizer
EOS_IDS = (2, 1)           # stories3m's generation_config: its stories end with BOS
ENDS_EARLY = "The bird flew away and was never seen again"   # stories3m: EOS after 90 tokens
BALL = PROMPTS[4]                                            # stories3m: EOS after 108


def _same(baseline: LLM, spec: LLM, prompts: list[str],          # noqa: F811
          params: list[SamplingParams]) -> list:
    """Both engines' outputs, asserted equal (tokens, text, finish and stop reasons); the
    speculative engine idle with nothing leaked."""
    want = baseline.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g, p in zip(want, got, params):
        for wo, go in zip(w.outputs, g.outputs):
            assert (go.token_ids, go.text, go.finish_reason, go.stop_reason) == \
                (wo.token_ids, wo.text, wo.finish_reason, wo.stop_reason), (w.prompt, p)
    assert_idle_and_clean(spec.llm_engine)
    return want


@pytest.mark.slow
def test_greedy_min_tokens_is_token_for_token_the_targets(baseline: LLM,       # noqa: F811
                                                          spec_llm: LLM) -> None:   # noqa: F811
    """A mixed batch: min_tokens past the model's own EOS, past a stop token id (".", which
    every story reaches early), holding a stop string back, next to requests without it."""
    g = dict(temperature=0.0)
    cases = [
        (ENDS_EARLY, SamplingParams(max_tokens=110, min_tokens=100, **g)),
        (ENDS_EARLY, SamplingParams(max_tokens=110, **g)),
        (BALL, SamplingParams(max_tokens=120, min_tokens=112, **g)),
        (PROMPTS[0], SamplingParams(max_tokens=60, min_tokens=25, stop_token_ids=[DOT], **g)),
        (PROMPTS[1], SamplingParams(max_tokens=60, stop_token_ids=[DOT], **g)),
        (PROMPTS[2], SamplingParams(max_tokens=60, min_tokens=9, stop_token_ids=[DOT, COMMA],
                                    **g)),
        (PROMPTS[3], SamplingParams(max_tokens=50, min_tokens=12, stop=[" the", "."], **g)),
        (PROMPTS[5], SamplingParams(max_tokens=40, n=2, min_tokens=30, stop_token_ids=[DOT],
                                    **g)),
        (PROMPTS[7], SamplingParams(max_tokens=45, **g)),
        (PROMPTS[9], SamplingParams(max_tokens=40, min_tokens=40, stop_token_ids=[DOT], **g)),
        (PROMPTS[0], SamplingParams(max_tokens=60, stop_token_ids=[DOT], **g)),
    ]
    prompts, params = [c[0] for c in cases], [c[1] for c in cases]
    want = _same(baseline, spec_llm, prompts, params)
    lens = [len(o.outputs[0].token_ids) for o in want]
    toks = [o.outputs[0].token_ids for o in want]
    # the tests prove something: min_tokens held back the EOS at 90 and the "." at 12 ...
    assert lens[1] == 90 and toks[1][-1] in EOS_IDS and lens[0] == 110
    assert not set(EOS_IDS) & set(toks[0])
    assert toks[0][:89] == toks[1][:89] and lens[2] == 120
    assert lens[10] < 25 and toks[10][-1] == DOT and toks[3][:lens[10] - 1] == toks[10][:-1]
    assert lens[3] > 25 and toks[3][-1] == DOT and toks[3].count(DOT) == 1
    # ... and speculation, preemption and prefix caching all happened
    stats = spec_llm.llm_engine.get_stats()
    assert stats.spec_decode.num_accepted_tokens > 0 and stats.num_preemptions > 0


@pytest.mark.slow
def test_min_tokens_boundary_at_every_offset(baseline: LLM, spec_llm: LLM) -> None:  # noqa: F811
    """A stop token right at the first allowed position: ``min_tokens`` 0..29 with "." as
    stop id; wherever a "." is the argmax at output token ``min_tokens + 1`` that token ends
    the output, at whichever verified position (draft or bonus) it falls."""
    prompts = [p for p in (PROMPTS[0], PROMPTS[2], PROMPTS[6]) for _ in range(30)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=k % 30,
                             stop_token_ids=[DOT]) for k in range(len(prompts))]
    want = _same(baseline, spec_llm, prompts, params)
    at_boundary = [k % 30 for k, o in enumerate(want)
                   if len(o.outputs[0].token_ids) == k % 30 + 1]
    assert len(at_boundary) >= 5, at_boundary


STORY = ("Once upon a time there was a little girl named Lily. She liked to play with her "
         "dog in the park. One day, the sun was big and she was very happy.")
SHAPING = {
    "logit_bias": dict(logit_bias={DOT: -4.0, COMMA: 3.0, 263: 2.5}),
    "allowed_token_ids": None,    # the ids of STORY (built from the tokenizer below)
    "bad_words": dict(bad_words=["the", "was very", "to play", "a cat"]),
    "repetition_penalty": dict(repetition_penalty=1.4),
    "presence_penalty": dict(presence_penalty=1.2),
    "frequency_penalty": dict(frequency_penalty=0.9),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPING))
def test_greedy_shaping_is_token_for_token_the_targets(baseline: LLM, spec_llm: LLM,  # noqa: F811
                                                       name: str) -> None:
    """One parameter at a time, in a batch where every other request does not use it: each
    verified position is shaped with the drafts before it in the output (bad words, the
    penalties' counts), so greedy output equals decoding without speculation."""
    kw = SHAPING[name]
    if kw is None:
        ids = sorted(set(baseline.get_tokenizer().encode(STORY)) | set(EOS_IDS))
        kw = dict(allowed_token_ids=ids)
    prompts = [PROMPTS[i] for i in (0, 4, 7, 10, 2, 5)]
    shaped = [SamplingParams(temperature=0.0, max_tokens=48, **kw) for _ in prompts]
    plain = [SamplingParams(temperature=0.0, max_tokens=48) for _ in prompts]
    params = [shaped[i] if i % 2 == 0 else plain[i] for i in range(len(prompts))]
    want = _same(baseline, spec_llm, prompts + prompts[:2],
                 params + [plain[0], SamplingParams(temperature=0.0, max_tokens=48, n=2, **kw)])
    changed = [w.outputs[0].token_ids != u.outputs[0].token_ids
               for w, u in zip(want[0:6:2], baseline.generate(
                   prompts[0:6:2], plain[0:6:2], use_tqdm=False))]
    assert any(changed), f"{name} changed no output: the test proves nothing"


def test_penalties_count_the_drafts_before_each_position() -> None:
    """The bundled model drafting for itself, 8 drafts, from one- or two-word prompts: the
    drafts are mostly new tokens, so whether a position counts the drafts before it decides
    the penalties there (measured: leaving them out changes this batch's output). Greedy
    output equals decoding without speculation; nothing leaks."""
    base = LLM(DEFAULT_MODEL, num_gpu_blocks=64)
    spec = LLM(DEFAULT_MODEL, num_gpu_blocks=64,
               speculative_config={"model": DEFAULT_MODEL, "num_speculative_tokens": 8})
    prompts, params = [], []
    for kw in (dict(presence_penalty=2.0), dict(repetition_penalty=1.5),
               dict(frequency_penalty=1.0), dict(presence_penalty=0.3),
               dict(frequency_penalty=0.2), dict(frequency_penalty=0.4, presence_penalty=-0.5,
                                                 repetition_penalty=1.1)):
        for i, prompt in enumerate(("Once", "The", "A", "Tom", "Lily", "One day")):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_tokens=40,
                                         **(kw if i != 2 else {})))
    _same(base, spec, prompts, params)
    assert spec.llm_engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_seeded_shaped_sampling_is_reproducible_and_keeps_min_tokens() -> None:
    """Random sampling under speculation with min_tokens (a stop id the model likes: ".")
    and penalties: no stop before token min_tokens + 1 in any sample, and a seeded request's
    samples are the same alone and in a batch."""
    llm = LLM(DEFAULT_MODEL, num_gpu_blocks=128,
              speculative_config={"model": DEFAULT_MODEL, "num_speculative_tokens": 4})
    params = [SamplingParams(temperature=0.8, max_tokens=30, min_tokens=k, seed=s, n=3,
                             stop_token_ids=[DOT], presence_penalty=0.4, frequency_penalty=0.2,
                             logit_bias={COMMA: 1.5})
              for s, k in ((1, 0), (2, 6), (3, 12), (4, 20))]
    prompts = ["Once", "The cat", "Lily saw", "One day"]
    alone = [llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    batched = llm.generate(prompts + prompts, params + [SamplingParams(temperature=0.0,
                                                                       max_tokens=20)] * 4,
                           use_tqdm=False)
    stopped = 0
    for a, b, p in zip(alone, batched, params):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for o in a.outputs:
            assert DOT not in o.token_ids[:p.min_tokens] and len(o.token_ids) > p.min_tokens
            stopped += o.finish_reason == "stop"
    assert stopped >= 4, "too few samples stopped: the test proves little"
    assert_idle_and_clean(llm.llm_engine)
