"""LoRA on GPTQ and AWQ bases (one rank and tensor-parallel): the adapter's update is added to
the output of the packed 4-bit linear, so nybble's outputs equal transformers + PEFT on the
dequantized base (float32 activations, the CPU kernel's exact mode)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nybble import LLM, LoRARequest, SamplingParams
from nybble.config import ModelConfig
from nybble.kernels.reference.attention import TorchAttentionBackend
from nybble.models.loader import load_model
from tests.conftest import shared_path
from tests.lora.adapters import PeftOracle, make_adapter

pytestmark = pytest.mark.slow
BASES = {"tiny-llama-gptq-4bit-g32": "gptq_model-4bit-32g.safetensors",
         "tiny-llama-awq-4bit-g32": "model.safetensors"}


def _dequantized_folder(gptq: str, weights: str, folder: str) -> str:
    """A float32 Hugging Face folder of the quantized model's dequantized weights."""
    loaded = load_model(ModelConfig(model=gptq, dtype="float32"), TorchAttentionBackend(),
                        torch.device("cpu"))
    raw = load_file(os.path.join(gptq, weights))
    tensors = {k: v.float() for k, v in raw.items()
               if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx", ".bias"))}
    assert all(not v.any() for k, v in raw.items() if k.endswith(".bias"))
    for module in loaded.model.modules():
        prefixes = getattr(module, "shard_prefixes", None)
        if prefixes is None:
            continue
        weight = module.dequantized_weight().float()
        for prefix, part in zip(prefixes, weight.split(module.shard_widths, 0)):
            tensors[f"{prefix}.weight"] = part.contiguous()
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(gptq, name), folder)
    with open(os.path.join(gptq, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("base", sorted(BASES))
def test_lora_on_a_quantized_base_equals_peft_on_the_dequantized_base(base: str, tp: int,
                                                                      tmp_path) -> None:
    # tp 2: each rank's packed shard plus its share of the adapter (tests/distributed/
    # test_tp_lora.py), the row-parallel partials summed by one all-reduce
    gptq = shared_path("fixtures", "quant", base)
    dense = _dequantized_folder(gptq, BASES[base], str(tmp_path / "dense"))
    adapter = make_adapter(dense, str(tmp_path / "a"), r=8, alpha=16, seed=1)
    prompt = [1, 40, 41, 42, 43, 44]
    with LLM(gptq, enable_lora=True, max_lora_rank=16, dtype="float32",
             cpu_activation_dtype="float32", cpu_prefill_gemm="float32",
             tensor_parallel_size=tp, threads=1) as llm:
        outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True, logprobs=3),
                            use_tqdm=False, lora_request=[None, LoRARequest("a", 1, adapter)])
    for out, path in zip(outs, (None, adapter)):
        oracle = PeftOracle(dense, path)
        tokens, logprobs = oracle.greedy(prompt, 6)
        sample = out.outputs[0]
        assert list(sample.token_ids) == tokens
        got = [step[t] for step, t in zip(sample.logprobs, sample.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 2e-4
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_lora_on_a_gguf_base_equals_peft_on_transformers_dequantized_gguf(tmp_path) -> None:
    """A llama.cpp Q4_0 file as the base: the oracle is transformers' own GGUF loader
    (it dequantizes every tensor to float32) with the PEFT adapter on top."""
    from transformers import AutoModelForCausalLM

    folder, name = shared_path("fixtures", "gguf"), "stories3m-Q4_0.gguf"
    dense = str(tmp_path / "dense")
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    hf.hf_quantizer = None                      # its weights are plain float32 tensors now
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(dense)
    adapter = make_adapter(dense, str(tmp_path / "a"), r=8, alpha=16, seed=2,
                           use_rslora=True)
    prompt = [1, 40, 41, 42, 43, 44]
    with LLM(os.path.join(folder, name), enable_lora=True, max_lora_rank=16,
             cpu_activation_dtype="float32", cpu_prefill_gemm="float32") as llm:
        outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True, logprobs=3),
                            use_tqdm=False, lora_request=[LoRARequest("a", 1, adapter), None])
    for out, path in zip(outs, (adapter, None)):
        tokens, logprobs = PeftOracle(dense, path).greedy(prompt, 6)
        sample = out.outputs[0]
        assert list(sample.token_ids) == tokens
        got = [step[t] for step, t in zip(sample.logprobs, sample.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 2e-4
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
