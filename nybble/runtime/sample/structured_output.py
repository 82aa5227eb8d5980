"""Structured output through ``xgrammar`` (Dong et al. 2024, "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models").

Engine-core side only: xgrammar imports torch, and its compiler needs the tokenizer's whole
vocabulary (the byte string of every token), so grammars are compiled here, in the process
that runs the model, never in the torch-free API process (which only checks a schema or regex
for a 400, :mod:`nybble.runtime.frontend.shaping_checks`). Compiled grammars are cached by xgrammar
(the same schema compiles once). Each sample gets its own :class:`GrammarMatcher`; the model
runner fills its token bitmask before sampling and advances it with the token the step
accepted (:class:`nybble.runtime.sample.logit_shaping.LogitShaping`). A request without a
constraint never touches this module.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from nybble.errors import InvalidRequestError
from nybble.sampling_params import GuidedDecodingParams

_PARAM = {"json": "response_format", "json_object": "response_format",
          "regex": "guided_regex", "choice": "guided_choice"}


class GrammarCompiler:
    """Compiles :class:`GuidedDecodingParams` for one model's tokenizer (built on first use).

    Args:
        tokenizer_folder: the model's tokenizer folder (loaded with transformers).
        vocab_size: the width of the model's logits (may exceed the tokenizer's).
        stop_token_ids: the model's EOS ids: the tokens that end a complete grammar.
    """

    def __init__(self, tokenizer_folder: str, vocab_size: int,
                 stop_token_ids: Sequence[int]) -> None:
        self.tokenizer_folder = tokenizer_folder
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None

    def _get(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.tokenizer_folder)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, g: GuidedDecodingParams) -> Any:
        """The compiled grammar of ``g``. JSON (a schema, or any object for ``json_object``)
        is compact: no free whitespace, so a small model cannot wander off into spaces.

        Raises:
            InvalidRequestError: xgrammar cannot compile the constraint (naming the API
                parameter that carried it).
        """
        compiler = self._get()
        kind = g.kind()[0]
        try:
            if kind == "json":
                return compiler.compile_json_schema(g.json, any_whitespace=False)
            if kind == "json_object":   # NOTE: an object (OpenAI's JSON mode), not any value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(g.regex)
            choices = " | ".join(json.dumps(c) for c in g.choice or ())
            return compiler.compile_grammar(f"root ::= {choices}")
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"{_PARAM[kind]} must be a constraint the grammar engine "
                                      f"can compile, got an error: {e}",
                                      param=_PARAM[kind]) from e

    def matchers(self, compiled: Any, n: int) -> list[GrammarMatcher]:
        """``n`` fresh matchers (one per sample) of a compiled grammar."""
        return [GrammarMatcher(compiled) for _ in range(n)]


class GrammarMatcher:
    """One sample's position in its grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row ``index`` of an int32 bitmask."""
        self._m.fill_next_token_bitmask(bitmask, index)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; ``False`` when the grammar refused it or has ended (it
        accepted a stop token): the sequence must end."""
        return bool(self._m.accept_token(token_id)) and not self._m.is_terminated()


class GrammarBitmask:
    """xgrammar's int32 token bitmask (``[rows, ceil(vocab / 32)]``, on the CPU) for the rows
    of a step that follow a grammar; the buffer is kept from step to step.

    Args:
        vocab_size: the width of the logits.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, matchers: list[GrammarMatcher]) -> None:
        """Set ``logits[k, t] = -inf`` (``[k, vocab]``, in place, on its device) for every
        token ``t`` that ``matchers[k]`` does not allow next."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(max(len(matchers), 8), self.vocab_size)
        for k, matcher in enumerate(matchers):
            matcher.fill(self._bitmask, k)
        self.reapply(logits, 0)

    def reapply(self, logits: torch.Tensor, first: int) -> None:
        """Mask ``logits`` (``[k, vocab]``) again by the rows ``first .. first + k - 1`` of
        the bitmask the last :meth:`apply` filled."""
        import xgrammar as xgr

        assert self._bitmask is not None, "apply() fills the bitmask first"
        mask = self._bitmask[first:first + logits.shape[0]]
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True))
