"""Test-only fault injection into an :class:`EngineCore` (never installed in normal runs).

The reliability tests make one part of a step, or of admission, raise once and check that
only the requests involved fail and that the engine serves the next ones as if nothing
happened. In-process tests call :func:`install_faults` on the engine's core; the engine-core
process of ``nybble serve`` calls it at start-up when the :data:`FAULTS_ENV` variable is set
(the tests start a server with it). Nothing is wrapped otherwise: no cost on the hot path.

A spec is a comma-separated list of ``point@call``: the ``call``-th call (1-based) of that
point raises :class:`InjectedFault`, every other call runs normally. Points:

- ``forward``: the model's forward pass (inside :meth:`ModelRunner.execute`);
- ``sampler``: the sampler (after the forward, inside the same method);
- ``add``: the scheduler's ``add`` in :meth:`EngineCore.add_request`, after the request's
  sampling rows were added (an admission that fails late).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nybble.runtime.worker import model_runner

if TYPE_CHECKING:
    from nybble.runtime.engine.engine_core import EngineCore

FAULTS_ENV = "NYBBLE_TEST_FAULTS"
"""Environment variable read by the engine-core process: a spec such as ``forward@1``."""

POINTS = ("forward", "sampler", "add")


class InjectedFault(RuntimeError):
    """The failure :func:`install_faults` injects."""


def parse_spec(spec: str) -> dict[str, set[int]]:
    """``"forward@1,sampler@3"`` -> ``{"forward": {1}, "sampler": {3}}``.

    Raises:
        ValueError: an unknown point or a call number below 1.
    """
    faults: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, call = item.partition("@")
        if point not in POINTS or not call.isdigit() or int(call) < 1:
            raise ValueError(f"{FAULTS_ENV} items must be POINT@CALL with POINT in {POINTS} "
                             f"and CALL >= 1, got {item!r}")
        faults.setdefault(point, set()).add(int(call))
    return faults


def _failing(point: str, calls: set[int], fn: Callable[..., Any]) -> Callable[..., Any]:
    count = [0]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] in calls:
            raise InjectedFault(f"injected {point} failure (call {count[0]})")
        return fn(*args, **kwargs)

    return wrapper


class _FailingAdd:
    """The scheduler, except that chosen calls of ``add`` raise (a Cython class cannot have
    a method replaced on the instance)."""

    def __init__(self, scheduler: Any, calls: set[int]) -> None:
        self._scheduler = scheduler
        self.add = _failing("add", calls, scheduler.add)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._scheduler


def install_faults(core: EngineCore, spec: str) -> dict[str, set[int]]:
    """Make the calls named in ``spec`` raise :class:`InjectedFault` (see the module's
    docstring). Returns the parsed spec.

    NOTE: ``sampler`` replaces the sampler of the module ``nybble.runtime.worker.model_runner``:
    process-wide, so in-process tests undo it (pytest's ``monkeypatch``) themselves.

    Raises:
        ValueError: a malformed spec.
    """
    faults = parse_spec(spec)
    if "forward" in faults:
        model = core.runner.model
        model.forward = _failing("forward", faults["forward"], model.forward)
    if "sampler" in faults:
        model_runner.sample = _failing("sampler", faults["sampler"], model_runner.sample)
    if "add" in faults:
        core.scheduler = _FailingAdd(core.scheduler, faults["add"])  # type: ignore[assignment]
    return faults
