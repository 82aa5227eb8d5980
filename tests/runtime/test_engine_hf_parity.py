"""Greedy generation through the engine equals transformers' greedy ``generate``, token for
token: the bundled real model and tiny random Llama / Mistral / Qwen2 checkpoints."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nybble import LLM, SamplingParams
from nybble.config import DEFAULT_MODEL

from ..models.hf_tiny import VARIANTS, make_tiny_model

STORY_PROMPTS = [
    "Once upon a time",
    "Tom and Sue",
    "The dog",
    "Lily wanted to",
    "One day, a little bird",
    "The sun was hot and",
    "Max had a big red ball. He",
    "In the park there was a tree",
    "Mom said,",
]


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (stops at the generation config's EOS ids)."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


_CACHE: dict[str, torch.nn.Module] = {}


def _hf_model(model_dir: str) -> torch.nn.Module:
    if model_dir not in _CACHE:
        _CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    return _CACHE[model_dir]


@pytest.fixture(scope="module")
def bundled_llm() -> LLM:
    return LLM(DEFAULT_MODEL, max_num_seqs=16)


@pytest.mark.slow
def test_bundled_model_greedy_matches_transformers(bundled_llm: LLM) -> None:
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    params = SamplingParams(temperature=0.0, max_tokens=80)
    outs = bundled_llm.generate(STORY_PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(STORY_PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        expected = hf_greedy(DEFAULT_MODEL, ids, 80)
        assert out.outputs[0].token_ids == expected, prompt
        # The text is the incremental detokenization of the same ids.
        want_text = tok.decode(ids + [t for t in expected if t not in (1, 2)],
                               skip_special_tokens=True)
        assert (prompt + out.outputs[0].text).strip() == want_text.strip()


@pytest.mark.slow
def test_bundled_model_stops_on_generation_config_eos(bundled_llm: LLM) -> None:
    # "The dog" ends its story with BOS (id 1), which only generation_config.json names as EOS;
    # transformers stops there too.
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    out = bundled_llm.generate("The dog", SamplingParams(temperature=0, max_tokens=300),
                               use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == 1
    assert out.token_ids == hf_greedy(DEFAULT_MODEL, tok("The dog").input_ids, 300)
    assert len(out.token_ids) < 300


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_models_greedy_match_transformers(variant: str, tmp_path) -> None:
    path = make_tiny_model(variant, str(tmp_path))
    llm = LLM(path, max_num_seqs=4, block_size=8)
    prompts = [[1, 5, 9, 200, 300], [1] + list(range(50, 90)), [1, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy_ignore_eos(path, p, 24)


def _hf_greedy_ignore_eos(model_dir: str, prompt: list[int], n: int) -> list[int]:
    """Plain argmax loop over transformers' full forward (no EOS handling at all)."""
    model = _hf_model(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
