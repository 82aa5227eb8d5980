"""Tokenizer metadata of a GGUF file written by ``nybble quantize --format gguf``.

The vocabulary is read with gguf-py's own helpers (:mod:`gguf.vocab`), tried in the order
llama.cpp's converter tries them for a Llama model: ``SentencePieceVocab`` (a
``tokenizer.model``; ``tokenizer.ggml.model`` = ``llama``, with scores), ``LlamaHfVocab`` (a
``tokenizer.json`` BPE with byte fallback, also ``llama``), ``BpeVocab`` (a byte-level BPE,
``gpt2``, with its merges and a pre-tokenizer name). ``SpecialVocab`` adds the BOS/EOS/UNK/PAD
ids, the ``add_*_token`` flags and the chat template. Keys: ggml's ``docs/gguf.md``
(``tokenizer.ggml.*``, ``tokenizer.chat_template``).

Two adjustments match what llama.cpp's converter writes for the same folder: the folder's
added tokens (``tokenizer.json``'s ``added_tokens``, ``tokenizer_config.json``'s
``added_tokens_decoder``) are ``CONTROL`` with score -1000 when special, else
``USER_DEFINED``; and a vocabulary shorter than
the model's embedding gets ``[PAD{i}]`` tokens of type ``UNUSED``.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONTROL_SCORE = -1000.0

_LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
                 "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace("\\p{N}{1,3}", "\\p{N}")
# NOTE: llama.cpp names a BPE pre-tokenizer (tokenizer.ggml.pre) by the regexes it splits
# with; these are the ones recognised from tokenizer.json, anything else is "default"
_PRE_BY_SPLIT = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def _pre_steps(pre: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not pre:
        return []
    return list(pre.get("pretokenizers", [])) if pre.get("type") == "Sequence" else [pre]


def bpe_pre_tokenizer(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for the pre-tokenizer of a byte-level BPE
    ``tokenizer.json``: ``llama-bpe`` (Llama 3's split regex), ``qwen2`` (Qwen2's),
    ``smollm`` (single digits, then GPT-2's byte-level regex: SmolLM, StarCoder), ``gpt-2``
    (GPT-2's byte-level regex alone), else ``default`` (with a warning: llama.cpp then splits
    with its generic regex)."""
    steps = _pre_steps(tokenizer_json.get("pre_tokenizer"))
    kinds = [s.get("type") for s in steps]
    for s in steps:
        if s.get("type") == "Split":
            regex = (s.get("pattern") or {}).get("Regex")
            if regex in _PRE_BY_SPLIT:
                return _PRE_BY_SPLIT[regex]
    byte_regex = any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps)
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_regex:
        return "smollm"
    if kinds == ["ByteLevel"] and byte_regex:
        return "gpt-2"
    logger.warning("unrecognised BPE pre-tokenizer %s: writing tokenizer.ggml.pre 'default' "
                   "(llama.cpp may split text differently from transformers)", kinds)
    return "default"


def load_vocab(model_dir: str) -> Any:
    """The gguf-py vocabulary of ``model_dir`` (see the module docstring for the order).

    Raises:
        ValueError: none of the three applies (no ``tokenizer.model`` and no BPE
            ``tokenizer.json``).
    """
    from gguf.vocab import BpeVocab, LlamaHfVocab, SentencePieceVocab

    path = Path(model_dir)
    if (path / "tokenizer.model").is_file():
        return SentencePieceVocab(path)
    for cls in (LlamaHfVocab, BpeVocab):
        try:
            return cls(path)
        except (FileNotFoundError, TypeError):
            continue
    raise ValueError(f"{model_dir!r} must hold a tokenizer GGUF can store: a SentencePiece "
                     f"tokenizer.model, or a tokenizer.json with a BPE model (byte fallback or "
                     f"byte-level)")


def added_tokens(model_dir: str) -> dict[int, tuple[str, bool]]:
    """``{id: (content, special)}`` of the folder's added tokens: ``tokenizer.json``'s
    ``added_tokens`` and ``tokenizer_config.json``'s ``added_tokens_decoder`` (the latter
    wins)."""
    out: dict[int, tuple[str, bool]] = {}
    for fname, key in (("tokenizer.json", "added_tokens"),
                       ("tokenizer_config.json", "added_tokens_decoder")):
        path = os.path.join(model_dir, fname)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            entries = json.load(f).get(key) or []
        if isinstance(entries, dict):
            entries = [{**v, "id": k} for k, v in entries.items()]
        for e in entries:
            out[int(e["id"])] = (str(e.get("content", "")), bool(e.get("special")))
    return out


def vocab_tokens(model_dir: str, vocab_size: int) -> tuple[Any, list[bytes], list[float],
                                                           list[int]]:
    """``(vocab, tokens, scores, types)`` of ``model_dir``, exactly ``vocab_size`` long:
    the vocabulary's tokens, then added tokens the vocabulary lacks at their ids, the rest
    ``[PAD{i}]``.

    Raises:
        ValueError: no usable tokenizer (:func:`load_vocab`), or more tokens than
            ``vocab_size`` (the model's embedding rows).
    """
    from gguf import TokenType

    vocab = load_vocab(model_dir)
    tokens, scores, types = [], [], []
    for text, score, typ in vocab.all_tokens():
        tokens.append(text)
        scores.append(float(score))
        types.append(int(typ))
    added = added_tokens(model_dir)
    top = max([len(tokens)] + [i + 1 for i in added])
    if top > vocab_size:
        raise ValueError(f"the tokenizer of {model_dir!r} has {top} tokens, more than the "
                         f"model's vocab_size {vocab_size}")
    n_vocab = len(tokens)
    for i in range(n_vocab, vocab_size):
        tokens.append(added[i][0].encode() if i in added else f"[PAD{i}]".encode())
        scores.append(CONTROL_SCORE)
        types.append(int(TokenType.UNUSED))
    for i, (_, special) in added.items():
        types[i] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        if special or i >= n_vocab:
            scores[i] = CONTROL_SCORE
    return vocab, tokens, scores, types


def add_tokenizer(writer: Any, model_dir: str, vocab_size: int) -> str:
    """Add ``tokenizer.ggml.*`` and ``tokenizer.chat_template`` of ``model_dir`` to the
    ``gguf.GGUFWriter`` ``writer``; returns ``tokenizer.ggml.model`` (``llama`` or ``gpt2``).

    Raises:
        ValueError: as :func:`vocab_tokens`.
    """
    from gguf.vocab import SpecialVocab

    vocab, tokens, scores, types = vocab_tokens(model_dir, vocab_size)
    model = vocab.tokenizer_model
    writer.add_tokenizer_model(model)
    pre = "default"
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if model == "gpt2" and tokenizer_json.is_file():
        with open(tokenizer_json, encoding="utf-8") as f:
            pre = bpe_pre_tokenizer(json.load(f))
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if model == "llama":
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = SpecialVocab(Path(model_dir), load_merges=model == "gpt2", n_vocab=len(tokens))
    jinja = Path(model_dir) / "chat_template.jinja"
    if special.chat_template is None and jinja.is_file():   # NOTE: gguf-py 0.17 does not read it
        special.chat_template = jinja.read_text(encoding="utf-8")
    special.add_to_gguf(writer, quiet=True)
    return str(model)
