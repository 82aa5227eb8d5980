"""The ``nybble`` command: one entry point, one subcommand per job.

Each subcommand lives next to the code it drives and exposes ``register(subparsers)``, which
adds its parser and sets ``func`` (called with the parsed namespace, returns an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# module -> the subcommands it registers (imported lazily so `nybble --help` stays fast)
_SUBCOMMAND_MODULES = (
    "nybble.server.cli",      # serve
    "nybble.generate_cli",    # generate
    "nybble.quantize.cli",    # quantize, eval-ppl
    "nybble.bench.cli",       # bench throughput | serve
)


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


def build_parser() -> argparse.ArgumentParser:
    """The full ``nybble`` argument parser with every subcommand."""
    parser = _Parser(
        prog="nybble",
        description="nybble: quantization-first LLM inference and serving engine.")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``nybble`` command line; returns the process exit code."""
    parser = build_parser()
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
