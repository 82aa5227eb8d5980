"""The engine-core busy loop (``CoreProc``) over real ZeroMQ sockets, with a scripted core:
every queued message is applied in order before a step, each step sends one outputs message,
a failed step fails the requests in the core, repeated failures end the process, the idle
core reports its stats once, and Shutdown stops it."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import zmq

from nybble.errors import EngineStepError, WorkerFailedError
from nybble.runtime.engine.core_process import MAX_CONSECUTIVE_STEP_FAILURES, CoreProc
from nybble.runtime.messages import (
    Codec,
    CoreInputs,
    EngineCoreFatal,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FromCore,
    RequestsFailed,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from nybble.sampling_params import SamplingParams

STATS = EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, 0, 16)


class ScriptedCore:
    """The EngineCore surface the loop uses; ``fail_steps`` steps raise, then steps emit one
    token per request and finish it."""

    def __init__(self, fail_steps: int = 0) -> None:
        self.requests: list[str] = []
        self.log: list[tuple[str, object]] = []
        self.fail_steps = fail_steps
        self.dead: list[str] = []     # tensor-parallel workers that are gone

    def add_request(self, request: EngineCoreRequest) -> None:
        self.log.append(("add", request.request_id))
        self.requests.append(request.request_id)

    def stop_samples(self, samples: list[tuple[str, int]]) -> None:
        self.log.append(("finish", samples))

    def abort_requests(self, ids: list[str]) -> None:
        self.log.append(("abort", list(ids)))
        self.requests = [r for r in self.requests if r not in ids]

    def take_failed_admissions(self) -> list[tuple[str, str, str | None]]:
        return []

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> EngineCoreOutputs:
        self.log.append(("step", list(self.requests)))
        if self.fail_steps:   # like EngineCore: the batch (here: the first request) rolls back
            self.fail_steps -= 1
            batch, self.requests = self.requests[:1], self.requests[1:]
            raise EngineStepError(batch, "RuntimeError: boom") from RuntimeError("boom\nline 2")
        ids, self.requests = self.requests, []
        return EngineCoreOutputs(request_ids=ids, sample_indices=[0] * len(ids),
                                 token_ids=[7] * len(ids), finish_reasons=[2] * len(ids))

    def get_stats(self) -> EngineStats:
        return STATS

    def dead_workers(self) -> list[str]:
        return list(self.dead)


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=1), [2], 0.0)


@pytest.fixture()
def sockets() -> Iterator[tuple[zmq.Socket, zmq.Socket, zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context()
    api_out, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, api_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    api_out.bind("inproc://in")
    core_in.connect("inproc://in")
    api_in.bind("inproc://out")
    core_out.connect("inproc://out")
    yield api_out, core_in, core_out, api_in
    ctx.destroy(linger=0)


def _run(core: ScriptedCore, sockets, messages: list[object]) -> tuple[int, list[object]]:
    api_out, core_in, core_out, api_in = sockets
    codec = Codec(FromCore)
    for m in messages:  # NOTE: all queued before the loop starts: one drain takes them all
        api_out.send(codec.encode(m))
    proc = CoreProc(core, core_in, core_out, os.getppid())
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(proc.run()))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    received = []
    while api_in.poll(100):
        received.append(codec.decode(api_in.recv()))
    return result[0], received


def test_drains_every_message_in_order_then_steps_once(sockets) -> None:
    core = ScriptedCore()
    code, out = _run(core, sockets, [
        CoreInputs(adds=[_request("a"), _request("b")]),
        CoreInputs(adds=[_request("c")], finishes=[("a", 0)], aborts=["b"]),
        UtilityCall(1, "get_stats"), UtilityCall(2, "nope"), Shutdown()])
    assert code == 0
    assert core.log == [("add", "a"), ("add", "b"), ("add", "c"), ("finish", [("a", 0)]),
                        ("abort", ["b"])]   # Shutdown came in the same drain: no step
    assert out[0] == UtilityResult(1, result=STATS)
    assert isinstance(out[1], UtilityResult) and "get_stats" in out[1].error


def test_one_outputs_message_per_step_then_idle_stats(sockets) -> None:
    api_out, *_ = sockets
    core = ScriptedCore()
    codec = Codec(FromCore)
    original = core.step

    def step_then_shutdown() -> EngineCoreOutputs:
        api_out.send(codec.encode(Shutdown()))  # NOTE: arrives for the next drain
        return original()

    core.step = step_then_shutdown  # type: ignore[method-assign]
    code, out = _run(core, sockets, [CoreInputs(adds=[_request("a"), _request("b")])])
    assert code == 0
    (step,) = out
    assert isinstance(step, EngineCoreOutputs)
    assert step.request_ids == ["a", "b"] and step.token_ids == [7, 7]
    assert step.stats == STATS


def test_a_failed_step_fails_only_its_batch(sockets) -> None:
    core = ScriptedCore(fail_steps=1)
    api_out, *_ = sockets
    codec = Codec(FromCore)
    original = core.step

    def step_then_shutdown() -> EngineCoreOutputs:
        if not core.fail_steps:
            api_out.send(codec.encode(Shutdown()))
        return original()

    core.step = step_then_shutdown  # type: ignore[method-assign]
    code, out = _run(core, sockets, [CoreInputs(adds=[_request("a"), _request("b")])])
    assert code == 0
    failed, step = out
    assert failed == RequestsFailed(["a"], "the engine step failed: RuntimeError: boom")
    assert isinstance(step, EngineCoreOutputs) and step.request_ids == ["b"]


def test_a_broken_core_fails_everything_and_gives_up_at_once(sockets) -> None:
    core = ScriptedCore()

    def broken_schedule() -> EngineCoreOutputs:
        raise RuntimeError("block 3 is freed twice\ndetails")

    core.step = broken_schedule  # type: ignore[method-assign]
    code, out = _run(core, sockets, [CoreInputs(adds=[_request("a"), _request("b")])])
    assert code == 1
    why = "the engine core's bookkeeping failed: RuntimeError: block 3 is freed twice"
    assert out == [RequestsFailed(["a", "b"], f"the engine can no longer step: {why}"),
                   EngineCoreFatal(why)]


def test_failed_steps_fail_the_requests_and_repeated_failures_end_the_core(sockets) -> None:
    core = ScriptedCore(fail_steps=MAX_CONSECUTIVE_STEP_FAILURES)
    api_out, *_ = sockets
    codec = Codec(FromCore)
    original = core.step

    def step_and_refill() -> EngineCoreOutputs:
        try:
            return original()
        finally:  # NOTE: a new request arrives after each failure
            api_out.send(codec.encode(CoreInputs(adds=[_request(f"r{len(core.log)}")])))

    core.step = step_and_refill  # type: ignore[method-assign]
    code, out = _run(core, sockets, [CoreInputs(adds=[_request("a")])])
    assert code == 1
    failed = [m for m in out if isinstance(m, RequestsFailed)]
    assert len(failed) == MAX_CONSECUTIVE_STEP_FAILURES
    assert failed[0].request_ids == ["a"]
    assert failed[0].message == "the engine step failed: RuntimeError: boom"
    assert isinstance(out[-1], EngineCoreFatal)
    assert f"{MAX_CONSECUTIVE_STEP_FAILURES} engine steps failed in a row" in out[-1].message


def test_a_good_step_resets_the_failure_count(sockets) -> None:
    core = ScriptedCore(fail_steps=MAX_CONSECUTIVE_STEP_FAILURES - 1)
    api_out, *_ = sockets
    codec = Codec(FromCore)
    original = core.step
    steps = []

    def step_and_refill() -> EngineCoreOutputs:
        steps.append(1)
        try:
            return original()
        finally:
            if len(steps) < MAX_CONSECUTIVE_STEP_FAILURES + 1:
                api_out.send(codec.encode(CoreInputs(adds=[_request(f"r{len(steps)}")])))
            else:
                api_out.send(codec.encode(Shutdown()))

    core.step = step_and_refill  # type: ignore[method-assign]
    code, out = _run(core, sockets, [CoreInputs(adds=[_request("a")])])
    assert code == 0   # the failures were not consecutive enough to give up
    assert sum(isinstance(m, RequestsFailed) for m in out) == MAX_CONSECUTIVE_STEP_FAILURES - 1
    assert isinstance(out[-1], EngineCoreOutputs) and out[-1].request_ids


def test_a_dead_tensor_parallel_worker_ends_the_core_at_once(sockets) -> None:
    core = ScriptedCore()

    def worker_gone() -> EngineCoreOutputs:
        batch, core.requests = core.requests[:1], core.requests[1:]
        raise EngineStepError(batch, "WorkerFailedError: rank 1 exited") from \
            WorkerFailedError("rank 1 (pid 7) exited with code -9")

    core.step = worker_gone  # type: ignore[method-assign]
    code, out = _run(core, sockets, [CoreInputs(adds=[_request("a"), _request("b")])])
    assert code == 1    # no second step: the API process turns unhealthy (/health 503)
    why = "WorkerFailedError: rank 1 (pid 7) exited with code -9"
    assert out == [RequestsFailed(["a"], f"the engine step failed: {why}"),
                   RequestsFailed(["b"], f"the engine can no longer step: {why}"),
                   EngineCoreFatal(why)]


def test_a_worker_found_dead_while_idle_ends_the_core(sockets, monkeypatch) -> None:
    monkeypatch.setattr("nybble.runtime.engine.core_process.PARENT_CHECK_S", 0.0)
    core = ScriptedCore()
    core.dead = ["rank 1 (pid 7) exited with code -9"]
    code, out = _run(core, sockets, [])
    assert code == 1
    assert out == [EngineCoreFatal("WorkerFailedError: tensor-parallel worker failed: "
                                   "rank 1 (pid 7) exited with code -9")]
