"""The ``nybble`` command imports only the chosen subcommand's module, lists every subcommand
without importing any, and takes ``--log-level`` before or after the subcommand."""
from __future__ import annotations

import subprocess
import sys

import pytest

from nybble.cli import build_parser

HEAVY = ("torch", "transformers", "fastapi", "numpy", "httpx", "zmq", "tokenizers")


def _modules_after(code: str) -> set[str]:
    probe = (f"import sys\n{code}\n"
             "print(' '.join(sorted(m for m in sys.modules if m.startswith('nybble.') or "
             f"m.split('.')[0] in {HEAVY!r})))\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, timeout=120)
    return set(proc.stdout.split())


def test_help_imports_no_subcommand_module() -> None:
    loaded = _modules_after("from nybble.cli import build_parser\n"
                           "build_parser(['--help']).format_help()")
    assert not {m for m in loaded if m.split(".")[1] in ("server", "bench", "quantize",
                                                         "generate_cli")}, loaded
    assert not loaded & set(HEAVY)


@pytest.mark.parametrize(("argv", "own", "others", "light"), [
    (["serve"], "nybble.server.cli", ("nybble.bench", "nybble.quantize", "nybble.generate_cli"),
     True),
    (["generate", "x"], "nybble.generate_cli", ("nybble.server", "nybble.bench"), True),
    (["bench", "serve"], "nybble.bench.cli", ("nybble.server", "nybble.quantize"), False),
])
def test_only_the_chosen_subcommand_is_imported(argv: list[str], own: str,
                                                others: tuple[str, ...], light: bool) -> None:
    loaded = _modules_after("from nybble.cli import build_parser\n"
                           f"build_parser({argv!r}).parse_args({argv!r})")
    assert own in loaded
    assert not [m for m in loaded if m.startswith(others)], loaded
    if light:  # NOTE: parsing serve/generate flags loads no heavy library at all
        assert not loaded & set(HEAVY), loaded


@pytest.mark.parametrize("argv", [["--log-level", "DEBUG", "serve"],
                                  ["serve", "--log-level", "DEBUG"],
                                  ["eval-ppl", "m", "--text", "t", "--log-level", "DEBUG"]])
def test_log_level_before_or_after_the_subcommand(argv: list[str]) -> None:
    assert build_parser(argv).parse_args(argv).log_level == "DEBUG"


def test_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "nybble", "--version"], capture_output=True,
                          text=True, check=True, timeout=60)
    assert proc.stdout.strip() == "nybble 0.1.0"
