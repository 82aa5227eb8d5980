"""Multi-LoRA under tensor parallelism (``LLM(tensor_parallel_size=2, enable_lora=True)``, the
``mp`` executor, gloo on loopback): each rank holds its base layer's share of every adapter
(``A`` whole and ``B``'s output rows on q/k/v and gate/up; ``A``'s input columns and ``B``
whole on o and down, summed by the layer's all-reduce), so a mixed batch of base and adapter
requests gives what transformers + PEFT give for each alone (greedy tokens and top-5
logprobs, float32) — with adapters moving between slots while requests wait."""
from __future__ import annotations

import pytest

from nybble import LLM, LoRARequest, SamplingParams
from nybble.config import DEFAULT_MODEL
from tests.distributed.tp_ranks import tiny_model
from tests.lora.adapters import check_against_peft, make_adapter

pytestmark = pytest.mark.slow
PROMPTS = ["Once upon a time", "Tom and Sue went to the park", "The little dog",
           "Lily had a red ball"]
STEPS = 8


def _mixed_batch(base: str, folder, max_loras: int) -> None:
    a = make_adapter(base, str(folder / "a"), r=8, alpha=16, seed=1,
                     rank_pattern={"down_proj": 4}, alpha_pattern={"q_proj": 3})
    b = make_adapter(base, str(folder / "b"), r=16, alpha=8, seed=2, use_rslora=True)
    loras = [None, LoRARequest("a", 1, a), LoRARequest("b", 2, b), LoRARequest("a", 1, a)]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=5)
    with LLM(base, tensor_parallel_size=2, enable_lora=True, max_loras=max_loras,
             max_lora_rank=16, dtype="float32", threads=1) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    check_against_peft(base, outs, loras, STEPS)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3


def test_bundled_model_tp2_lora_mixed_batch_equals_peft(tmp_path) -> None:
    # 8 query heads over 4 KV heads: each rank holds half the heads and half the MLP
    _mixed_batch(DEFAULT_MODEL, tmp_path, max_loras=2)


def test_replicated_kv_head_tp2_lora_one_slot_equals_peft(tmp_path) -> None:
    # one KV head on both ranks (k/v's B kept whole on each); one slot: "a" and "b" take
    # turns in it, so the workers refill the slot while the other adapter's requests wait
    _mixed_batch(tiny_model(str(tmp_path / "model"), "llama", kv_heads=1), tmp_path,
                 max_loras=1)
