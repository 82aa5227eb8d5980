"""The API process's side of the engine (``AsyncEngine``) against a scripted core client:
outputs reach the streams, a stop string goes back to the core as a finish, a failed step and
the core's death end each request with its own error, a cancelled stats caller harms nothing,
and shutdown ends every stream with an abort."""
from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from nybble.config import DEFAULT_MODEL
from nybble.outputs import RequestOutput
from nybble.runtime.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    EngineShutdownError,
    StepRecord,
)
from nybble.runtime.frontend.input_processor import InputProcessor
from nybble.runtime.messages import (
    EngineCoreFatal,
    EngineCoreOutputs,
    EngineStats,
    RequestLimits,
    RequestsFailed,
    UtilityResult,
)
from nybble.runtime.frontend.output_processor import OutputProcessor
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.sampling_params import SamplingParams

STATS = EngineStats(1, 0, 7, 8, 0.125, 0, 1, 3, 5, 16)


class ScriptedClient:
    """The CoreClient surface AsyncEngine uses; the test plays the core through ``inbox``."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[object] = asyncio.Queue()
        self.sent: list[tuple[str, Any]] = []
        self.alive = True
        self.on_exit: Any = None
        self.pid = 0

    def watch(self) -> None:
        pass

    def add_request(self, request: Any) -> None:
        self.sent.append(("add", request.request_id))

    def finish_sample(self, request_id: str, index: int) -> None:
        self.sent.append(("finish", (request_id, index)))

    def abort(self, request_id: str) -> None:
        self.sent.append(("abort", request_id))

    def flush(self) -> None:
        pass

    def call(self, method: str) -> int:
        self.sent.append(("call", method))
        return len(self.sent)

    async def recv(self) -> object:
        return await self.inbox.get()

    async def shutdown(self) -> None:
        self.alive = False

    def die(self, code: int) -> None:
        self.alive = False
        self.on_exit(code)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(DEFAULT_MODEL)


def _setup(tok: Tokenizer) -> tuple[AsyncEngine, ScriptedClient, InputProcessor]:
    client = ScriptedClient()
    engine = AsyncEngine(client, tok)  # type: ignore[arg-type]
    engine.start()
    return engine, client, InputProcessor(tok, RequestLimits(512, 512, 8, 20, 64, 16), (2,))


def _step(rid: str, tokens: list[int], finish: list[int] | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(request_ids=[rid] * len(tokens),
                             sample_indices=list(range(len(tokens))), token_ids=tokens,
                             finish_reasons=finish or [0] * len(tokens), stats=STATS)


async def _drain(stream: Any) -> list[Any]:
    return [out async for out in stream]


def test_outputs_reach_the_stream_and_a_stop_string_is_sent_back(tok: Tokenizer) -> None:
    async def go() -> None:
        engine, client, gate = _setup(tok)
        req = gate.process("r", "Once upon", SamplingParams(max_tokens=8, stop=[" time"]))
        stream = await engine.add_request(req, "Once upon")
        a, time_ = tok.encode(" a time", add_special_tokens=False)[-2:]
        client.inbox.put_nowait(_step("r", [a]))
        client.inbox.put_nowait(_step("r", [time_]))
        client.inbox.put_nowait(_step("r", [a]))   # NOTE: the core ran on before the finish
        outs = await asyncio.wait_for(_drain(stream), 10)
        final = outs[-1].outputs[0]
        assert final.text == " a" and final.finish_reason == "stop" and final.stop_reason == " time"
        assert ("finish", ("r", 0)) in client.sent
        await engine.shutdown()

    asyncio.run(go())


def test_failures_end_each_request_with_its_own_error(tok: Tokenizer) -> None:
    async def go() -> None:
        engine, client, gate = _setup(tok)
        streams = engine.add_requests(
            [gate.process(r, "Hi", SamplingParams(max_tokens=4)) for r in ("a", "b", "c")],
            ["Hi"] * 3)
        client.inbox.put_nowait(RequestsFailed(["a", "b"], "the engine step failed: X"))
        errors = []
        for s in streams[:2]:
            with pytest.raises(EngineRequestError, match="step failed") as info:
                await asyncio.wait_for(_drain(s), 10)
            errors.append(info.value)
        assert errors[0] is not errors[1]                    # one exception object each
        client.inbox.put_nowait(EngineCoreFatal("3 engine steps failed in a row"))
        with pytest.raises(EngineDeadError, match="can no longer step"):
            await asyncio.wait_for(_drain(streams[2]), 10)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await engine.add_request(gate.process("d", "Hi", SamplingParams()))
        await engine.shutdown()

    asyncio.run(go())


def test_core_exit_fails_streams_and_stats_callers(tok: Tokenizer) -> None:
    async def go() -> None:
        engine, client, gate = _setup(tok)
        stream = await engine.add_request(gate.process("a", "Hi", SamplingParams()))
        stats = asyncio.ensure_future(engine.get_stats())
        await asyncio.sleep(0)
        client.die(-9)
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.wait_for(_drain(stream), 10)
        with pytest.raises(EngineDeadError):
            await stats
        assert not engine.is_healthy and not engine.is_running
        await engine.shutdown()

    asyncio.run(go())


def test_a_cancelled_stats_caller_harms_nothing(tok: Tokenizer) -> None:
    async def go() -> None:
        engine, client, gate = _setup(tok)
        stream = await engine.add_request(gate.process("a", "Hi", SamplingParams(max_tokens=1)))
        first = asyncio.ensure_future(engine.get_stats())
        await asyncio.sleep(0)
        first.cancel()
        second = asyncio.ensure_future(engine.get_stats())
        await asyncio.sleep(0)
        methods = [arg for kind, arg in client.sent if kind == "call"]
        calls = [i + 1 for i, (kind, _) in enumerate(client.sent) if kind == "call"]
        assert methods == ["get_stats"] * 2
        for call_id in calls:        # the core answers both, the first caller is gone
            client.inbox.put_nowait(UtilityResult(call_id, result=STATS))
        client.inbox.put_nowait(_step("a", [403], [2]))
        assert await asyncio.wait_for(second, 10) == STATS
        (out,) = await asyncio.wait_for(_drain(stream), 10)   # the request was not failed
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert engine.is_healthy
        await engine.shutdown()

    asyncio.run(go())


def test_shutdown_ends_streams_with_an_abort(tok: Tokenizer) -> None:
    async def go() -> None:
        engine, client, gate = _setup(tok)
        stream = await engine.add_request(gate.process("a", "Hi", SamplingParams(n=2)))
        client.inbox.put_nowait(_step("a", [403, 403]))
        first = await asyncio.wait_for(stream.__anext__(), 10)
        assert not first.finished
        engine.begin_shutdown()
        (last,) = await asyncio.wait_for(_drain(stream), 10)
        assert last.finished and [o.finish_reason for o in last.outputs] == ["abort"] * 2
        assert isinstance(stream.error, EngineShutdownError)
        assert ("abort", "a") in client.sent and not engine.is_running
        with pytest.raises(EngineShutdownError):
            await engine.add_request(gate.process("b", "Hi", SamplingParams()))
        await engine.shutdown()

    asyncio.run(go())


def _steps(rid: str, n: int, length: int, seed: int = 0) -> list[EngineCoreOutputs]:
    """``length`` steps of ``n`` samples with logprobs (top 2); the last step finishes them."""
    rng = random.Random(seed)
    steps = []
    for k in range(length):
        tokens = [rng.randrange(3, 512) for _ in range(n)]
        step = _step(rid, tokens, [2 if k == length - 1 else 0] * n)
        step.logprobs = [-rng.random() for _ in range(n)]
        step.top_token_ids = [[rng.randrange(3, 512), rng.randrange(3, 512)] for _ in range(n)]
        step.top_logprobs = [[-0.1, -0.2] for _ in range(n)]
        steps.append(step)
    return steps


def test_deltas_merge_into_the_cumulative_result(tok: Tokenizer) -> None:
    """The server's engine sends deltas; merged, they equal the offline engine's cumulative
    snapshot of the same steps (text, ids, logprobs, finish), whether read step by step or
    all at once by a slow reader, whose stream holds one merged output."""
    gate = InputProcessor(tok, RequestLimits(512, 512, 8, 20, 64, 16), (2,))
    req = gate.process("r", "Once upon", SamplingParams(n=3, max_tokens=40, logprobs=2,
                                                         stop=["zz"]))
    cumulative = OutputProcessor(tok)
    cumulative.add_request(req, "Once upon")
    for step in _steps("r", 3, 40):
        (expected,), _ = cumulative.process_outputs(step)

    async def go(read_each_step: bool) -> RequestOutput:
        engine, client, _ = _setup(tok)
        stream = await engine.add_request(req, "Once upon")
        whole: RequestOutput | None = None
        for step in _steps("r", 3, 40):
            client.inbox.put_nowait(step)
            if read_each_step:
                out = await asyncio.wait_for(stream.__anext__(), 10)
                assert len(out.outputs[0].token_ids) == 1      # a delta, not a snapshot
                whole = out if whole is None else (whole.add(out) or whole)
        if not read_each_step:
            while client.inbox.qsize():
                await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert stream._unread is not None and stream._unread.finished   # one merged output
            (whole,) = await asyncio.wait_for(_drain(stream), 10)
        await engine.shutdown()
        assert whole is not None
        return whole

    for read_each_step in (True, False):
        whole = asyncio.run(go(read_each_step))
        assert whole.finished and whole.outputs == expected.outputs


def test_admission_control_refuses_beyond_the_waiting_limit(tok: Tokenizer) -> None:
    async def go() -> None:
        client = ScriptedClient()
        engine = AsyncEngine(client, tok, max_num_waiting_requests=2)  # type: ignore[arg-type]
        engine.start()
        gate = InputProcessor(tok, RequestLimits(512, 512, 8, 20, 64, 16), (2,))

        def reqs(*ids: str) -> list[Any]:
            return [gate.process(r, "Hi", SamplingParams(max_tokens=4)) for r in ids]

        engine.add_requests(reqs("a", "b"), [None, None])
        with pytest.raises(EngineOverloadedError, match="2 requests are waiting") as info:
            engine.add_requests(reqs("c"), [None])
        assert info.value.retry_after_s >= 1
        assert ("add", "c") not in client.sent and engine.num_waiting == 2
        client.inbox.put_nowait(EngineCoreOutputs(first_scheduled=["a"], stats=STATS))
        for _ in range(5):
            await asyncio.sleep(0)
        assert engine.num_waiting == 1
        engine.add_requests(reqs("c"), [None])                 # room for one again
        engine.abort("b")
        engine.abort("c")
        assert engine.num_waiting == 0
        engine.add_requests(reqs("d", "e", "f"), [None] * 3)   # too many, but none waits
        await engine.shutdown()

    asyncio.run(go())


def test_aborts_and_failures_reach_the_observer_once_each(tok: Tokenizer) -> None:
    records: list[StepRecord] = []

    async def go() -> None:
        client = ScriptedClient()
        engine = AsyncEngine(client, tok, observer=records.append)  # type: ignore[arg-type]
        engine.start()
        gate = InputProcessor(tok, RequestLimits(512, 512, 8, 20, 64, 16), (2,))
        engine.add_requests([gate.process(r, "Hi", SamplingParams(max_tokens=4))
                             for r in "abcd"], [None] * 4)
        client.inbox.put_nowait(_step("a", [403]))
        for _ in range(5):
            await asyncio.sleep(0)
        engine.abort("a")
        engine.abort("a")                                   # already gone: not counted again
        client.inbox.put_nowait(RequestsFailed(["b", "c"], "the engine step failed: X"))
        for _ in range(5):
            await asyncio.sleep(0)
        engine.begin_shutdown()                             # ends "d"
        await engine.shutdown()

    asyncio.run(go())
    assert sum(r.aborted for r in records) == 2 and sum(r.failed for r in records) == 2
    assert [rid for r in records for rid in r.first_token_ids] == ["a"]


def test_stats_line_rates_skip_idle_gaps(tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    """The stats line's window opens at the first busy step after idle: 100 tokens over 5 s
    read 20 tokens/s, and after a long idle gap the next line reads the new period's rate,
    not one diluted by the gap."""
    engine = AsyncEngine(ScriptedClient(), tok, stats_interval_s=5.0)  # type: ignore[arg-type]

    def step(now: float, tokens: int) -> None:
        engine._maybe_log(StepRecord([], STATS, generation_tokens=tokens, now=now))

    with caplog.at_level("INFO", logger="nybble.runtime.frontend.async_engine"):
        step(1000.0, 7)                       # first busy step: opens the window
        for i in range(1, 11):
            step(1000.0 + 0.5 * i, 10)
        engine._on_outputs(EngineCoreOutputs(stats=STATS))   # the core went idle
        step(5000.0, 7)                       # an hour later
        step(5002.5, 25)
        step(5005.0, 25)
    lines = [r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage()]
    assert len(lines) == 2
    assert "generation throughput: 20.0 tokens/s" in lines[0]
    assert "generation throughput: 10.0 tokens/s" in lines[1]
