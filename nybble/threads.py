"""Torch intra-op threads: the ``--threads`` flag, its default, and the OpenMP wait policy.

Why a default other than torch's: torch starts one OpenMP thread per logical CPU, and idle
OpenMP threads spin-wait. On a machine whose cores are busy (other processes, or the HTTP
process beside the engine core) the spinning threads steal the cores the working ones need:
measured on a shared 2-core box, single-stream decode of the bundled model ran at 8 tokens/s
with torch's default threads and ~300 tokens/s with one thread.

The rule (:func:`resolve_threads`): ``--threads N`` wins; else ``OMP_NUM_THREADS`` when the
environment sets it; else the physical cores this process may run on, minus one (left for the
HTTP side) when there are more than two, and 1 on one or two cores. The OpenMP wait policy is
``PASSIVE`` (idle threads sleep instead of spinning) unless the environment says otherwise.
Both must be set before torch is imported (:func:`set_thread_env`); torch's own setting follows
(:mod:`nybble.runtime.worker.torch_threads`). This module imports no torch: the API server process
uses it too.
"""
from __future__ import annotations

import argparse
import os

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
NUM_THREADS_ENV = "OMP_NUM_THREADS"


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once).

    Reads Linux's CPU topology (``/sys/devices/system/cpu/cpuN/topology``); elsewhere, or when
    it is unreadable, every allowed logical CPU counts as a core.
    """
    allowed = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
               else set(range(os.cpu_count() or 1)))
    cores = set()
    for cpu in allowed:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{base}/core_id") as f:
                cores.add((package, f.read().strip()))
        except OSError:
            return len(allowed)
    return max(len(cores), 1)


def default_threads(cores: int | None = None) -> int:
    """``cores - 1`` when there are more than two physical cores, else 1."""
    n = physical_cores() if cores is None else cores
    return n - 1 if n > 2 else 1


def resolve_threads(requested: int | None) -> tuple[int, str]:
    """The intra-op thread count and where it came from (for the start-up log line).

    Raises:
        ValueError: ``requested`` (or ``OMP_NUM_THREADS``) is not an integer >= 1.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads must be >= 1, got {requested}")
        return requested, "--threads"
    env = os.environ.get(NUM_THREADS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{NUM_THREADS_ENV} must be an integer >= 1, got {env!r}")
        return n, NUM_THREADS_ENV
    return default_threads(), f"default for {physical_cores()} physical cores"


def set_thread_env(threads: int) -> None:
    """Export the thread count and the passive wait policy for OpenMP.

    NOTE: OpenMP reads these once, when torch loads it: call this before ``import torch``.
    A wait policy already set in the environment is kept.
    """
    os.environ[NUM_THREADS_ENV] = str(threads)
    os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def add_threads_arg(parser: argparse.ArgumentParser, default_help: str | None = None) -> None:
    """Add ``--threads`` to a subcommand that runs the model; ``default_help`` replaces the
    description of the default when the subcommand picks its own (``nybble quantize``)."""
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads of the process that runs the model (default: " + (
            default_help or "$OMP_NUM_THREADS if set, else the physical cores minus one when "
                            "there are more than two, else 1") +
        "; idle threads sleep: OMP_WAIT_POLICY=PASSIVE)")
