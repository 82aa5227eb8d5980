"""Benchmark models: the bundled stories260k and a randomly initialised Llama of realistic shape.

The random model (``llama-random``: hidden 768, 12 layers, 12 heads, intermediate 2048, vocab
32000, ~134 M parameters) is created on the fly with transformers' ``LlamaConfig`` and
``save_pretrained`` into a cache folder, once per shape, so CPU figures are not dominated by a
toy model's per-step overhead. Its weights are random: compare speeds, never text. It reuses the
bundled tokenizer files (vocabulary 512 < 32000): benchmark prompts are token ids drawn from that
vocabulary, which are valid ids of the bigger embedding.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass

from nybble.config import DEFAULT_MODEL

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json")


@dataclass(frozen=True)
class RandomLlamaShape:
    """Shape of the random-weights Llama (sizes in elements, lengths in tokens)."""

    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    seed: int = 0

    @property
    def dirname(self) -> str:
        """Cache folder name, unique per shape and seed."""
        return (f"llama-h{self.hidden_size}-l{self.num_hidden_layers}-a{self.num_attention_heads}"
                f"-kv{self.num_key_value_heads}-i{self.intermediate_size}-v{self.vocab_size}"
                f"-p{self.max_position_embeddings}-s{self.seed}")


MODEL_ALIASES = ("stories260k", "llama-random")
"""Names ``--model`` accepts besides a folder path."""


def cache_dir() -> str:
    """Where generated benchmark models live (``$NYBBLE_CACHE`` or ``~/.cache/nybble``)."""
    root = os.environ.get("NYBBLE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "nybble")
    return os.path.join(root, "bench-models")


def random_llama(shape: RandomLlamaShape | None = None, root: str | None = None) -> str:
    """Return the folder of the random Llama of ``shape``, creating and caching it if needed.

    The weights come from ``LlamaForCausalLM(config)`` after ``torch.manual_seed(shape.seed)``
    and are saved in float32 safetensors; the tokenizer files are copied from stories260k.
    Creation writes into a temporary folder renamed at the end, so a crash leaves no half model.
    """
    shape = shape or RandomLlamaShape()
    path = os.path.join(root or cache_dir(), shape.dirname)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    logger.info("creating random Llama %s in %s", shape.dirname, path)
    params = asdict(shape)
    seed = params.pop("seed")
    config = LlamaConfig(**params, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        src = os.path.join(DEFAULT_MODEL, name)
        if os.path.exists(src):
            shutil.copy(src, tmp)
    with open(os.path.join(tmp, "BENCH_MODEL.md"), "w") as f:
        f.write("Random-weights Llama made by nybble.bench.models for speed benchmarks only; "
                "tokenizer copied from stories260k (vocab 512 < model vocab).\n")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(name: str | None) -> str:
    """Map ``None`` / ``stories260k`` / ``llama-random`` / a folder to a model folder path."""
    if name in (None, "stories260k"):
        return DEFAULT_MODEL
    if name == "llama-random":
        return random_llama()
    if not os.path.isdir(name):
        raise ValueError(f"model must be a folder or one of {MODEL_ALIASES}, got {name!r}")
    return name


def model_vocab_size(path: str) -> int:
    """``vocab_size`` from the model folder's ``config.json``."""
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def model_max_len(path: str) -> int:
    """``max_position_embeddings`` from the model folder's ``config.json`` (tokens)."""
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["max_position_embeddings"])
