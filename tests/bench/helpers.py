"""Helpers of the benchmark tests: run the ``bench`` CLI, load ``benchmarks/plot.py``."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from types import ModuleType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_main(argv: list[str]) -> int:
    """Parse ``argv`` with only the ``bench`` subcommand registered and run it."""
    from nybble.bench.cli import register

    parser = argparse.ArgumentParser(prog="nybble")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def plot_module() -> ModuleType:
    """``benchmarks/plot.py`` imported from its path (``benchmarks`` is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_plot", os.path.join(REPO, "benchmarks",
                                                                            "plot.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
