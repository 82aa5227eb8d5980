"""Tensor-parallel workers' life: a dead worker fails the step with WorkerFailedError (no
hang), workers exit with their parent, and ``shutdown`` leaves no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from nybble import LLM, SamplingParams
from nybble.errors import EngineStepError, WorkerFailedError


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_killed_worker_fails_the_step_with_worker_failed_and_shutdown_is_clean():
    llm = LLM(tensor_parallel_size=2, threads=1, distributed_timeout_s=20)
    core = llm.llm_engine.engine_core
    (worker,) = core.executor.procs
    params = SamplingParams(temperature=0, max_tokens=4)
    assert len(llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    worker.kill()
    worker.wait(10)
    start = time.monotonic()
    with pytest.raises(EngineStepError) as info:
        llm.generate(["Once"], params, use_tqdm=False)
    assert time.monotonic() - start < 10     # no collective waits for the dead rank
    assert isinstance(info.value.__cause__, WorkerFailedError)
    assert "rank 1" in str(info.value.__cause__)
    core.shutdown()
    core.shutdown()     # idempotent


@pytest.mark.slow
def test_stop_ends_the_workers():
    llm = LLM(tensor_parallel_size=2, threads=1)
    core = llm.llm_engine.engine_core
    (worker,) = core.executor.procs
    core.shutdown()
    assert worker.poll() == 0     # STOP: a clean exit, not a kill


_PARENT = """
import sys, time
from nybble import LLM
llm = LLM(tensor_parallel_size=2, threads=1)
print(llm.llm_engine.engine_core.executor.procs[0].pid, flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_workers_exit_when_their_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE,
                              text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _gone(worker_pid, within_s=10), f"worker {worker_pid} outlived its parent"
    finally:
        parent.kill()
