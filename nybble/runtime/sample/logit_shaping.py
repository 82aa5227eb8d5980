"""LogitShaping: the model runner's per-sequence logit processors, applied on the device.

What it applies, in this order, to the logits of the rows that use it (vLLM V1's order: the
masks and biases, then the penalties):

1. a static additive row per sequence: ``logit_bias``, ``-inf`` outside
   ``allowed_token_ids`` and on single-token ``bad_words`` (one gather-add for the batch);
2. multi-token ``bad_words``: the last token of a word is ``-inf`` when the output ends with
   the word's other tokens;
3. penalties over per-row token counts: ``repetition_penalty`` over the prompt and the output
   (a positive logit is divided by it, a negative one multiplied: Keskar et al. 2019, as
   transformers' ``RepetitionPenaltyLogitsProcessor``), then OpenAI's
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over the output;
4. ``min_tokens``: the sequence's stop ids (EOS, ``stop_token_ids``) are ``-inf`` while it has
   fewer than ``min_tokens`` output tokens;
5. structured output: the grammar's token bitmask (``xgrammar``).

State lives in rows of its own (its own :class:`~nybble.runtime.sample.rows.RowAllocator`; why
not the sampling table's rows is said there), only for sequences that shape (a request
without shaping gets none, and a step with no shaping row returns the logits untouched: one
``len`` check). The token counts are ``[rows, vocab]`` tensors on the device, updated in
place by :meth:`accept` each step (one scatter for the batch, never rebuilt from token
lists); a row is written whole when a sequence is added, so a freed row carries nothing over.
Preemption by recompute keeps the row (the output tokens stay output tokens); a failed step
aborts its requests, which frees their rows.

Speculative decoding (:class:`VerifyLayout`) shapes the ``m + 1`` verified positions of a
sample as non-speculative decoding would shape each of those tokens: at offset ``j`` the
output is ``j`` tokens longer (``min_tokens``) and ends with the sample's drafts ``0 .. j-1``
(``bad_words``, the penalties' counts), added to per-row copies, never to the rows' state;
:meth:`accept` then records every emitted token.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from nybble.runtime.messages import EngineCoreRequest
from nybble.runtime.sample.rows import RowAllocator
from nybble.runtime.sample.shaping_rows import NEG_INF, VerifyLayout, banned_next, static_row
from nybble.runtime.sample.structured_output import GrammarBitmask, GrammarMatcher


class LogitShaping:
    """Per-sequence logit processors, addressed by scheduler sequence id.

    Args:
        vocab_size: the width of the logits.
        device: where the logits live.
        capacity: initial rows; doubles when full.
    """

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._num = dict.fromkeys(("bias", "pen", "min", "bad", "grammar"), 0)
        self._bias = torch.zeros(0, vocab_size, device=device)
        self._prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._host: dict[str, np.ndarray] = {}
        self._stops: list[np.ndarray | None] = []
        self._bad: list[list[tuple[tuple[int, ...], int]] | None] = []
        self._history: list[list[int] | None] = []
        self._matchers: list[GrammarMatcher | None] = []
        self._bitmask = GrammarBitmask(vocab_size)
        self._allocator = RowAllocator(capacity, self._grow)

    def __len__(self) -> int:
        """Sequences with a shaping row."""
        return len(self._allocator)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._allocator

    def _grow(self, old: int, capacity: int) -> None:
        """Grow every column from ``old`` to ``capacity`` rows (the allocator's ``on_grow``)."""
        for name, dtype in (("rep", np.float32), ("pres", np.float32), ("freq", np.float32),
                            ("min", np.int64), ("out", np.int64), ("bias", np.bool_),
                            ("pen", np.bool_)):
            col = np.zeros(capacity, dtype)
            col[:old] = self._host.get(name, col[:0])
            self._host[name] = col
        # NOTE: the big per-row tensors are allocated for the first row that needs them
        for name in ("_bias", "_prompt", "_counts"):
            t = getattr(self, name)
            if t.shape[0]:
                grown = t.new_zeros(capacity, self.vocab_size)
                grown[:old] = t
                setattr(self, name, grown)
        for lst in (self._stops, self._bad, self._history, self._matchers):
            lst += [None] * (capacity - old)

    def _table(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        if t.shape[0] < self._allocator.capacity:
            t = t.new_zeros(self._allocator.capacity, self.vocab_size)
            setattr(self, name, t)
        return t

    def add(self, first_seq_id: int, request: EngineCoreRequest,
            matchers: list[GrammarMatcher] | None = None) -> None:
        """Add the rows of a request's ``num_sequences`` sequences if its parameters shape the logits
        (else nothing). ``matchers``: one grammar matcher per sample, for structured output.

        Raises:
            ValueError: a sequence id already has a row.
        """
        p = request.params
        if not (p.shaped or request.bad_words_token_ids):
            return
        ids = range(first_seq_id, first_seq_id + p.num_sequences)
        static = static_row(request, self.vocab_size, self.device)
        multi = [(tuple(w[:-1]), w[-1]) for w in request.bad_words_token_ids if len(w) > 1]
        prompt = torch.tensor(request.prompt_token_ids, dtype=torch.int64, device=self.device)
        stops = np.asarray(request.stop_token_ids, np.int64) if p.min_tokens else None
        h = self._host
        for i, row in enumerate(self._allocator.add(ids)):
            h["rep"][row], h["pres"][row] = p.repetition_penalty, p.presence_penalty
            h["freq"][row], h["min"][row], h["out"][row] = p.frequency_penalty, p.min_tokens, 0
            h["bias"][row], h["pen"][row] = static is not None, p.penalized
            if static is not None:
                self._table("_bias")[row] = static
            if p.penalized:
                self._table("_counts")[row].zero_()
                mask = self._table("_prompt")[row]
                mask.zero_()
                mask[prompt] = True
            self._stops[row] = stops
            self._bad[row] = multi or None
            self._history[row] = [] if multi else None
            self._matchers[row] = None if matchers is None else matchers[i]
            self._count(row, +1)

    def _count(self, row: int, sign: int) -> None:
        h, n = self._host, self._num
        n["bias"] += sign * bool(h["bias"][row])
        n["pen"] += sign * bool(h["pen"][row])
        n["min"] += sign * bool(h["min"][row] > 0)
        n["bad"] += sign * (self._bad[row] is not None)
        n["grammar"] += sign * (self._matchers[row] is not None)

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Drop the rows of ``seq_ids`` (finished or aborted); ids without a row are
        ignored."""
        if not self._allocator:
            return
        for seq_id in seq_ids:
            row = self._allocator.remove(seq_id)
            if row is None:
                continue
            self._count(row, -1)
            self._stops[row] = self._bad[row] = self._history[row] = None
            self._matchers[row] = None

    def _rows(self, seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(batch rows, shaping rows)`` of the sequences in ``seq_ids`` that shape."""
        return self._allocator.find(seq_ids.tolist())

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)

    def apply(self, logits: torch.Tensor, seq_ids: np.ndarray,
              layout: VerifyLayout | None = None) -> torch.Tensor:
        """The shaped logits of a step.

        Args:
            logits: ``[N, vocab]`` float32 logits, row ``i`` sampled for ``seq_ids[i]``.
            seq_ids: int64[N] sequence ids (a speculative step repeats a sample's id over its
                ``m + 1`` rows).
            layout: a speculative step's row offsets and drafts; ``None``: each row is its
                sequence's next token.

        Returns:
            ``logits`` itself when no row shapes; else a shaped copy (the raw logits stay
            for logprobs).
        """
        if not self._allocator:
            return logits
        found = self._rows(seq_ids)
        if found is None:
            return logits
        rows, slots = found
        logits = logits.clone()
        h, n = self._host, self._num
        if n["bias"]:
            m = h["bias"][slots]
            if m.any():
                logits.index_add_(0, self._t(rows[m]), self._bias[self._t(slots[m])])
        if n["bad"]:
            hits = [(i, last) for i, s in zip(rows.tolist(), slots.tolist())
                    for last in banned_next(self._bad[s], self._history[s] if layout is None
                                                   else layout.history(i, self._history[s]))]
            if hits:
                ban = torch.tensor(hits, device=self.device)
                logits[ban[:, 0], ban[:, 1]] = NEG_INF
        if n["pen"]:
            m = h["pen"][slots]
            if m.any():
                self._penalize(logits, rows[m], slots[m], layout)
        before_min = None
        if n["min"]:
            out = h["out"][slots] if layout is None else h["out"][slots] + layout.offsets[rows]
            m = out < h["min"][slots]
            if m.any():
                before_min = logits.clone() if n["grammar"] else None
                r = np.concatenate([np.full(len(self._stops[s]), i)   # type: ignore[arg-type]
                                    for i, s in zip(rows[m], slots[m])])
                t = np.concatenate([self._stops[s] for s in slots[m]])  # type: ignore[misc]
                logits[self._t(r), self._t(t)] = NEG_INF
        if n["grammar"]:
            self._apply_grammar(logits, rows, slots, before_min)
        return logits

    def _penalize(self, logits: torch.Tensor, rows: np.ndarray, slots: np.ndarray,
                  layout: VerifyLayout | None) -> None:
        r, s = self._t(rows), self._t(slots)
        h = self._host
        counts = self._counts[s]    # NOTE: a gather: a copy the drafts may be added to
        if layout is not None:
            k, drafts = layout.preceding(rows)
            if len(k):
                k_t = self._t(k)
                counts.index_put_((k_t, self._t(drafts)),
                                  torch.ones_like(k_t, dtype=torch.int32), accumulate=True)
        out_seen = counts > 0
        x = logits[r]
        rep = self._t(h["rep"][slots])[:, None]
        seen = out_seen | self._prompt[s]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x -= self._t(h["freq"][slots])[:, None] * counts
        x -= self._t(h["pres"][slots])[:, None] * out_seen
        logits[r] = x

    def _apply_grammar(self, logits: torch.Tensor, rows: np.ndarray, slots: np.ndarray,
                       before_min: torch.Tensor | None) -> None:
        use = [(i, s) for i, s in zip(rows.tolist(), slots.tolist())
               if self._matchers[s] is not None]
        if not use:
            return
        r = torch.tensor([i for i, _ in use], device=self.device)
        sub = logits[r]
        self._bitmask.apply(sub, [self._matchers[s] for _, s in use])   # type: ignore[misc]
        if before_min is not None:
            # NOTE: a complete grammar allows only its stop tokens, which min_tokens may have
            # banned: the grammar wins (its stop ids get their logits back, the sample ends
            # valid instead of argmaxing an all -inf row)
            for k in torch.isinf(sub).all(dim=-1).nonzero().flatten().tolist():
                stops = self._stops[use[k][1]]
                if stops is not None and len(stops):
                    ids = torch.from_numpy(stops).to(self.device)
                    row = sub[k:k + 1]
                    row[0, ids] = before_min[use[k][0], ids]
                    self._bitmask.reapply(row, k)   # only the grammar's stops
        logits[r] = sub

    def accept(self, seq_ids: np.ndarray, tokens: np.ndarray,
               num_tokens: np.ndarray | None = None) -> list[int]:
        """Record one step's sampled tokens (``tokens[i]`` for ``seq_ids[i]``): counts, output
        lengths, bad-word histories, grammar matchers.

        Args:
            seq_ids: ``int64[S]`` distinct sequence ids.
            tokens: ``int[S]``; with ``num_tokens`` (a speculative step), ``int[S, W]``, row
                ``i`` emitting ``tokens[i, :num_tokens[i]]`` in order.
            num_tokens: ``int[S]`` tokens per row, or ``None`` (one each).

        Returns:
            The sequences whose grammar has terminated (it accepted a stop token) or refused
            the token: the engine core ends them.
        """
        if not self._allocator:
            return []
        found = self._rows(seq_ids)
        if found is None:
            return []
        rows, slots = found
        h, n = self._host, self._num
        toks = tokens[rows].astype(np.int64).reshape(len(rows), -1)
        num = np.ones(len(rows), np.int64) if num_tokens is None else \
            num_tokens[rows].astype(np.int64)
        valid = np.arange(toks.shape[1])[None, :] < num[:, None]
        h["out"][slots] += num   # NOTE: one row per sequence per step: slots are distinct
        if n["pen"]:
            m = valid & h["pen"][slots][:, None]
            if m.any():
                s = self._t(np.broadcast_to(slots[:, None], toks.shape)[m])
                self._counts.index_put_((s, self._t(toks[m])),
                                        torch.ones_like(s, dtype=torch.int32), accumulate=True)
        done: list[int] = []
        if n["bad"] or n["grammar"]:
            for s, row, k, seq in zip(slots.tolist(), toks.tolist(), num.tolist(),
                                      seq_ids[rows].tolist()):
                history = self._history[s]
                if history is not None:
                    history += row[:k]
                    keep = max(len(p) for p, _ in self._bad[s] or ())   # type: ignore[union-attr]
                    del history[:-keep]
                matcher = self._matchers[s]
                if matcher is not None and not all(matcher.accept(t) for t in row[:k]):
                    done.append(seq)
        return done

    def output_len(self, seq_id: int) -> int:
        """Output tokens recorded for ``seq_id`` (for tests)."""
        return int(self._host["out"][self._allocator.row(seq_id)])

    def counts(self, seq_id: int) -> torch.Tensor:
        """``[vocab]`` int32 output-token counts of ``seq_id`` (for tests)."""
        return self._counts[self._allocator.row(seq_id)].cpu()
