"""Beam search inside the engine core: every live beam is a scheduler sequence.

A beam-search request of width ``k`` enters the scheduler as one parallel-sampling group of
``k`` (it weighs ``k`` against ``max_num_seqs`` from the start); its prompt is computed once
and the group forks into the ``k`` first beams, sharing the prompt's KV blocks. Then each
step, in the same forward as every other request (one row per live beam):

1. the runner returns each beam row's ``K`` most likely next tokens (greedy rows asking for
   ``K`` logprobs, see :func:`~nybble.runtime.engine.beam_search.num_candidates`);
2. :class:`~nybble.runtime.engine.beam_search.BeamSearch` picks the next ``k`` beams;
3. a beam continued once gets its token through ``Scheduler.update``; a beam continued ``m``
   times is also forked ``m - 1`` times (``Scheduler.fork``: the children share its blocks by
   reference count, the partial last block is copied on its first write); a beam not
   continued is finished at once, so its blocks are freed in the same step;
4. when the search ends, the live beams are finished and the ``n`` best hypotheses leave as
   ordinary sample rows of :class:`EngineCoreOutputs` (their whole token ids at once), with
   their cumulative log-probabilities.

A step that samples only some beams of a request (the others were preempted or did not fit
the token budget) declines their tokens (``-1`` to ``update``): those beams compute their
last token again next step, so the beams of a request always advance together.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from nybble.runtime.engine.beam_search import Beam, BeamSearch, Continuation, Hypothesis
from nybble.runtime.messages import EngineCoreOutputs, EngineCoreRequest
from nybble.runtime.worker.model_runner import ModelRunner, ModelRunnerOutput
from nybble.runtime.scheduler.scheduler import Scheduler
from nybble.runtime.scheduler.sequence import FinishReason
from nybble.sampling_params import SamplingParams


@dataclass(slots=True)
class _BeamRequest:
    """The core's record of one beam-search request."""

    request_id: str
    n: int
    search: BeamSearch
    row_params: SamplingParams              # the runner's row of one beam (n = 1)
    group: range                            # the seq ids of the first k beams
    live: list[Beam] = field(default_factory=list)
    started: bool = False                   # the prompt has been sampled


@dataclass(slots=True)
class _Plan:
    """What to do after ``update`` for one request this step."""

    request: _BeamRequest
    nxt: list[Continuation]
    prune: list[int]
    forks: list[tuple[int, int, int]]       # (parent seq id, new seq id, token)


class BeamCoordinator:
    """Runs the beam-search requests of an engine core (see the module docstring).

    Args:
        scheduler: the core's scheduler.
        runner: the core's model runner (its sampling table holds a row per live beam).
        new_seq_ids: hands out ``count`` fresh consecutive sequence ids, returns the first.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner,
                 new_seq_ids: Callable[[int], int]) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._new_seq_ids = new_seq_ids
        self.requests: dict[str, _BeamRequest] = {}
        self.owner: dict[int, str] = {}         # seq id of a live beam -> request id
        self._plans: list[_Plan] = []
        self._done: list[_BeamRequest] = []
        self.num_declined = 0                   # beam rows declined (waiting for siblings)
        self.freed: list[int] = []              # seq ids ended since the core last looked

    def add(self, request: EngineCoreRequest) -> int:
        """Queue a validated beam-search request; all or nothing. Returns its first seq id."""
        p = request.params
        width = p.beam_width if p.beam_width is not None else p.n
        search = BeamSearch(width, request.max_tokens, p.length_penalty, p.early_stopping,
                            tuple(request.stop_token_ids))
        row = SamplingParams(n=width, temperature=0.0, logprobs=search.num_candidates,
                             max_tokens=request.max_tokens)
        first = self._new_seq_ids(width)
        group = range(first, first + width)
        try:
            self.runner.add_sampling_rows(first, row)
            self.scheduler.add(first, np.asarray(request.prompt_token_ids, np.int32),
                               request.max_tokens, np.zeros(0, np.int32), width)
        except BaseException:
            self.runner.remove_sequences(group)
            raise
        record = _BeamRequest(request.request_id, p.n, search, replace(row, n=1), group,
                              [Beam(first, [], np.float32(0.0))])
        self.requests[request.request_id] = record
        for sid in group:
            self.owner[sid] = request.request_id
        return first

    def live_seq_ids(self, request_id: str) -> list[int]:
        """The scheduler sequences of a request (the whole group before its first step)."""
        record = self.requests[request_id]
        return list(record.group) if not record.started else [b.seq_id for b in record.live]

    def abort(self, request_id: str) -> None:
        """Finish a request's beams now (blocks and sampling rows freed; their ids join
        :attr:`freed`). Unknown ids are ignored."""
        if request_id in self.requests:
            self._end(self.live_seq_ids(request_id))
            del self.requests[request_id]

    def _end(self, seq_ids: list[int]) -> None:
        """Finish beams ``seq_ids`` (blocks, sampling rows and ownership freed)."""
        for sid in seq_ids:
            self.scheduler.finish(sid, int(FinishReason.ABORTED))
            self.owner.pop(sid, None)
        self.runner.remove_sequences(seq_ids)
        self.freed += seq_ids

    # ------------------------------------------------------------------ the step
    def before_update(self, sample_seq_ids: np.ndarray, result: ModelRunnerOutput
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Decide this step for every beam request sampled in it.

        Args:
            sample_seq_ids: ``int64[S]`` the batch's sampled sequences.
            result: the runner's output for them (``top_token_ids`` / ``top_logprobs`` at
                least ``K`` wide on beam rows).

        Returns:
            ``(tokens int32[S], is_beam bool[S])``: the tokens to pass ``Scheduler.update``
            (beam rows replaced, ``-1`` where declined) and which rows are beams.
        """
        # NOTE: plans of a step that failed before after_update() belong to aborted requests
        self._plans.clear()
        self._done.clear()
        sids = sample_seq_ids.tolist()
        is_beam = np.fromiter((s in self.owner for s in sids), bool, len(sids))
        tokens = result.token_ids.copy()
        rows: dict[str, dict[int, int]] = {}
        for r in np.flatnonzero(is_beam).tolist():
            rows.setdefault(self.owner[sids[r]], {})[sids[r]] = r
        assert result.top_token_ids is not None and result.top_logprobs is not None
        for rid, by_seq in rows.items():
            record = self.requests[rid]
            if not record.started:
                self._first_step(record, by_seq, result, tokens)
            elif by_seq.keys() != {b.seq_id for b in record.live}:
                tokens[list(by_seq.values())] = -1      # NOTE: wait for the missing beams
                self.num_declined += len(by_seq)
            else:
                self._step(record, by_seq, result, tokens)
        return tokens, is_beam

    def _first_step(self, record: _BeamRequest, by_seq: dict[int, int],
                    result: ModelRunnerOutput, tokens: np.ndarray) -> None:
        """The prompt is sampled: its group's rows become the first beams."""
        prompt_row = by_seq[record.group.start]
        nxt = record.search.step(record.live, result.top_token_ids[[prompt_row]],
                                 result.top_logprobs[[prompt_row]])
        record.started = True
        for cont, sid in zip(nxt, record.group):
            tokens[by_seq[sid]] = cont.token
        record.live = [Beam(sid, [c.token], c.logprob) for c, sid in zip(nxt, record.group)]
        if record.search.done:
            record.live = [Beam(sid, [], np.float32(0)) for sid in record.group]
            self._done.append(record)

    def _step(self, record: _BeamRequest, by_seq: dict[int, int], result: ModelRunnerOutput,
              tokens: np.ndarray) -> None:
        beams = record.live
        order = [by_seq[b.seq_id] for b in beams]
        nxt = record.search.step(beams, result.top_token_ids[order], result.top_logprobs[order])
        if record.search.done:
            self._done.append(record)
            return
        plan = _Plan(record, nxt, [], [])
        taken: set[int] = set()
        new_live = []
        for cont in nxt:
            parent = cont.parent.seq_id
            if parent not in taken:
                taken.add(parent)
                tokens[by_seq[parent]] = cont.token
                sid = parent
            else:
                sid = self._new_seq_ids(1)
                plan.forks.append((parent, sid, cont.token))
            new_live.append(Beam(sid, cont.parent.token_ids + [cont.token], cont.logprob))
        plan.prune = [b.seq_id for b in beams if b.seq_id not in taken]
        record.live = new_live
        self._plans.append(plan)

    def after_update(self) -> list[tuple[str, list[Hypothesis]]]:
        """Carry out the step's plans (prune, then fork) once ``update`` has run.

        Returns:
            ``(request_id, the n best hypotheses)`` of every request whose search ended.
        """
        for plan in self._plans:
            rid = plan.request.request_id
            self._end(plan.prune)
            for parent, sid, token in plan.forks:
                self.scheduler.fork(parent, sid, token)
                self.runner.add_sampling_rows(sid, plan.request.row_params)
                self.owner[sid] = rid
        self._plans.clear()
        finished = []
        for record in self._done:
            del self.requests[record.request_id]
            self._end([b.seq_id for b in record.live])
            finished.append((record.request_id, record.search.finished[:record.n]))
        self._done.clear()
        return finished


def add_results(outputs: EngineCoreOutputs, results: list[tuple[str, list[Hypothesis]]]) -> None:
    """Append the hypotheses as sample rows (one row per token; the last row carries the
    finish code: STOPPED after an EOS, else LENGTH) and their cumulative log-probabilities."""
    if not results:
        return
    width = 0 if outputs.top_token_ids is None or not outputs.top_token_ids else \
        len(outputs.top_token_ids[0])
    cumulative = outputs.cumulative_logprobs = outputs.cumulative_logprobs or {}
    for rid, hyps in results:
        cumulative[rid] = [h.cumulative_logprob for h in hyps]
        for index, h in enumerate(hyps):
            last = FinishReason.STOPPED if h.ended_by_eos else FinishReason.LENGTH
            for j, token in enumerate(h.token_ids):
                outputs.request_ids.append(rid)
                outputs.sample_indices.append(index)
                outputs.token_ids.append(token)
                outputs.finish_reasons.append(int(last) if j == len(h.token_ids) - 1 else 0)
                # NOTE: beam requests ask for no logprobs; keep the columns aligned
                if outputs.logprobs is not None:
                    outputs.logprobs.append(0.0)
                if outputs.top_token_ids is not None and outputs.top_logprobs is not None:
                    outputs.top_token_ids.append([token] * width)
                    outputs.top_logprobs.append([0.0] * width)
