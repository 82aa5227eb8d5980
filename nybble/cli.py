"""The ``nybble`` command: one entry point, one subcommand per job.

Each subcommand lives next to the code it drives and exposes ``register(subparsers)``, which
adds its parser and sets ``func`` (called with the parsed namespace, returns an exit code).
Only the chosen subcommand's module is imported (``nybble serve`` never loads the benchmark or
quantization code); ``nybble --help`` lists them all without importing any.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from nybble.version import __version__

# subcommand -> (the module that registers it, its one-line help)
_SUBCOMMANDS = {
    "serve": ("nybble.server.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("nybble.generate_cli", "generate text for one or more prompts"),
    "quantize": ("nybble.quantize.cli",
                 "quantize a model folder (RTN, GPTQ, AWQ, GPTQ+E2E) to GPTQ/AWQ or GGUF"),
    "eval-ppl": ("nybble.quantize.cli", "perplexity of a model on a text file"),
    "bench": ("nybble.bench.cli", "benchmark throughput or serving latency"),
    "plan": ("nybble.plan.cli", "memory plan: weights, KV cache, sequences that fit on a GPU"),
}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help already says its default,
    the default is ``None`` (the help says what happens then) or the flag is a switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action.default, bool) or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose help shows every flag's default (subcommands inherit the class)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


class _OnlyChosen:
    """The subparsers action seen by one module's ``register``: it adds only the chosen
    subcommand (``nybble.quantize.cli`` registers both ``quantize`` and ``eval-ppl``)."""

    def __init__(self, sub: argparse._SubParsersAction, chosen: str) -> None:
        self._sub, self._chosen = sub, chosen

    def add_parser(self, name: str, **kwargs: object) -> argparse.ArgumentParser:
        if name != self._chosen:
            return _Parser(prog=name, add_help=False)  # NOTE: not reachable from the command line
        parser = self._sub.add_parser(name, **kwargs)
        # NOTE: the global flags also after the subcommand; SUPPRESS keeps a value given
        # before it
        _add_global_flags(parser, log_level_default=argparse.SUPPRESS)
        return parser


def _add_global_flags(parser: argparse.ArgumentParser, log_level_default: str) -> None:
    """``--version`` and ``--log-level``: accepted before and after the subcommand."""
    parser.add_argument("--version", action="version", version=f"nybble {__version__}")
    parser.add_argument("--log-level", default=log_level_default,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default: INFO)")


def chosen_subcommand(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first argument that is one), or ``None``."""
    return next((a for a in argv if a in _SUBCOMMANDS), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``nybble`` argument parser: the full parser of the subcommand ``argv`` names, a
    one-line entry for every other one. ``argv=None`` registers every subcommand fully."""
    parser = _Parser(
        prog="nybble",
        description="nybble: quantization-first LLM inference and serving engine.")
    _add_global_flags(parser, log_level_default="INFO")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = None if argv is None else chosen_subcommand(argv)
    for name, (module, help_text) in _SUBCOMMANDS.items():
        if argv is None or name == chosen:
            importlib.import_module(module).register(_OnlyChosen(sub, name))
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``nybble`` command line; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    from nybble.errors import NybbleError

    try:
        return int(args.func(args) or 0)
    except (NybbleError, ValueError, OSError) as e:
        # NOTE: a user error (bad flag value, missing folder) gets one line, not a traceback;
        # --log-level DEBUG shows the traceback.
        if args.log_level == "DEBUG":
            raise
        print(f"nybble {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
