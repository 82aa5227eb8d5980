"""Beam-search bookkeeping of one request: candidates, length-penalised scores, finished
hypotheses. Pure numpy; the engine core (:mod:`nybble.runtime.engine.beam_core`) feeds it each
step's top log-probabilities of every live beam and carries its decisions out on the KV cache.

The rule is transformers' beam search (``GenerationMixin._beam_search`` of transformers 5,
itself the semantics of its older ``BeamSearchScorer``); with the same settings the best
hypothesis equals ``generate(num_beams=k, do_sample=False, length_penalty=...,
early_stopping=...)`` token for token. Per step, with ``g`` tokens generated before it:

1. every live beam ``b`` (cumulative log-probability ``c_b``, float32) proposes its
   ``K = max(2, 1 + #eos) * k`` most likely next tokens; candidate score ``c_b + log p``;
   the ``K`` best candidates over all beams are kept, best first;
2. a candidate *hits a stop* when its token is an EOS id (never with ``ignore_eos``) or when
   it is the ``max_tokens``-th token (then every candidate hits);
3. the next live beams are the ``k`` best candidates that do not hit a stop;
4. among the first ``k`` candidates (not the rest of the ``K``: those only back up step 3),
   each that hits a stop becomes a finished hypothesis with score
   ``cumulative_logprob / (g + 1) ** length_penalty`` -- the *generated* length, the EOS token
   included, prompt excluded -- unless ``early_stopping is True`` and ``k`` hypotheses are
   already finished, or the heuristic of step 5 already said no improvement is possible;
   only the ``k`` best hypotheses are kept;
5. no improvement is possible once ``k`` hypotheses are finished and the best live beam's
   ``c / L ** length_penalty`` is not above the worst of them, where ``L = max_tokens`` when
   ``early_stopping == "never"`` and ``length_penalty > 0``, else ``L = g + 1``;
6. the search ends when no improvement is possible, when ``early_stopping is True`` and ``k``
   hypotheses are finished, or at ``max_tokens``.

The result is the finished hypotheses, best score first. vLLM's own beam search differs in
step 4 (its length is prompt + output without the EOS) and has no early stopping: nybble
follows transformers so that the reference is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nybble.sampling_params import num_candidates

EarlyStopping = bool | str
"""``True``, ``False`` or ``"never"`` (transformers' ``early_stopping``)."""


@dataclass(slots=True)
class Beam:
    """One live beam: its scheduler sequence, generated ids and cumulative log-probability."""

    seq_id: int
    token_ids: list[int]
    logprob: np.float32


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: generated ids (the EOS included when one ended it), cumulative
    log-probability (natural log, float32) and length-penalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    ended_by_eos: bool


@dataclass(slots=True)
class Continuation:
    """A next live beam: continue ``parent`` (a :class:`Beam`) with ``token``."""

    parent: Beam
    token: int
    logprob: np.float32


class BeamSearch:
    """The beam-search state of one request (see the module docstring for the rule).

    Args:
        beam_width: ``k`` live beams and finished hypotheses (>= 1).
        max_tokens: tokens to generate at most (>= 1).
        length_penalty: exponent of the generated length dividing a hypothesis' score.
        early_stopping: ``True``, ``False`` or ``"never"``.
        eos_token_ids: ids that end a beam (empty with ``ignore_eos``).
    """

    def __init__(self, beam_width: int, max_tokens: int, length_penalty: float,
                 early_stopping: EarlyStopping, eos_token_ids: tuple[int, ...]) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.eos = frozenset(eos_token_ids)
        self.num_candidates = num_candidates(beam_width, len(self.eos))
        self.live: list[Beam] = []
        self.finished: list[Hypothesis] = []
        self.num_generated = 0
        self._improvable = True
        self.done = False

    def _penalised(self, logprob: np.float32, length: int) -> np.float32:
        return np.float32(logprob / np.float32(float(length) ** self.length_penalty))

    def step(self, beams: list[Beam], top_ids: np.ndarray, top_logprobs: np.ndarray
             ) -> list[Continuation]:
        """Advance by one token.

        Args:
            beams: the live beams (the prompt as one beam at the first step).
            top_ids: ``int64[B, >= K]`` each beam's most likely next ids, best first.
            top_logprobs: ``float32[B, >= K]`` their log-probabilities (log-softmax of the
                raw logits).

        Returns:
            The next live beams, best first (empty when :attr:`done`).
        """
        k, K = self.beam_width, self.num_candidates
        ids = np.asarray(top_ids)[:, :K]
        acc = (np.asarray([b.logprob for b in beams], np.float32)[:, None]
               + np.asarray(top_logprobs, np.float32)[:, :K])
        # NOTE: stable sort over (beam, rank) order: ties go to the lower beam, as a top-k
        # over the flattened (beam, vocabulary) scores does
        order = np.argsort(-acc.reshape(-1), kind="stable")[:K]
        width = acc.shape[1]
        cands = [(beams[i // width], int(ids[i // width, i % width]), acc.reshape(-1)[i])
                 for i in order.tolist()]
        length = self.num_generated + 1
        last = length >= self.max_tokens
        hits = [last or tok in self.eos for _, tok, _ in cands]
        nxt = [Continuation(b, tok, lp) for (b, tok, lp), hit in zip(cands, hits) if not hit][:k]
        full = len(self.finished) == k
        if self._improvable and not (full and self.early_stopping is True):
            for (beam, tok, lp), hit in zip(cands[:k], hits[:k]):
                if hit:
                    self.finished.append(Hypothesis(beam.token_ids + [tok], float(lp),
                                                    float(self._penalised(lp, length)),
                                                    tok in self.eos))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[k:]
        self.num_generated = length
        if nxt and len(self.finished) == k:
            hyp_len = self.max_tokens if self.early_stopping == "never" and \
                self.length_penalty > 0 else length
            best = self._penalised(nxt[0].logprob, hyp_len)
            # NOTE: sticky, as in transformers: once no improvement is possible, none is
            self._improvable = self._improvable and bool(best > np.float32(self.finished[-1].score))
        self.done = last or not self._improvable or not nxt or \
            (self.early_stopping is True and len(self.finished) == k)
        return [] if self.done else nxt
