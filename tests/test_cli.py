"""The ``nybble`` command imports only the chosen subcommand's module, lists every subcommand
without importing any, takes its global flags (``--log-level``, ``--version``) before or after
the subcommand and a subcommand's flags before or after its positional arguments, and answers
a bad model path in well under a second, before any heavy import."""
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


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--version"],
                                  ["generate", "--version"]])
def test_version_before_or_after_the_subcommand(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "nybble", *argv], capture_output=True,
                          text=True, check=True, timeout=60)
    assert proc.stdout.strip() == "nybble 0.1.0"


@pytest.mark.parametrize(("argv", "field", "value"), [
    (["generate", "--max-tokens", "3", "hi"], "max_tokens", 3),
    (["generate", "hi", "--max-tokens", "3"], "max_tokens", 3),
    (["serve", "--port", "9", "some/model"], "model_tag", "some/model"),
    (["serve", "some/model", "--port", "9"], "port", 9),
    (["quantize", "--method", "rtn", "--out", "o", "m"], "model", "m"),
    (["quantize", "m", "--out", "o", "--method", "rtn"], "method", "rtn"),
])
def test_flags_before_or_after_positionals(argv: list[str], field: str, value: object) -> None:
    assert getattr(build_parser(argv).parse_args(argv), field) == value


MISSING = "/nonexistent/model"


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--model", MISSING],
    ["serve", MISSING],
    ["quantize", MISSING, "--method", "rtn", "--out", "/tmp/never-written"],
    ["eval-ppl", MISSING, "--text", "t.txt"],
    ["bench", "throughput", "--model", MISSING],
])
def test_a_missing_model_answers_before_heavy_imports(argv: list[str]) -> None:
    code = ("from nybble.cli import main\n"
            f"assert main({argv!r}) == 2\n")
    loaded = _modules_after(code)
    assert not loaded & {"torch", "transformers", "zmq", "tokenizers"}, loaded


@pytest.mark.parametrize("sub", [["generate", "hi", "--model"], ["serve"], ["eval-ppl"]])
def test_a_file_for_a_model_says_it_is_a_file(tmp_path, capsys, sub: list[str]) -> None:
    from nybble.cli import main

    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    argv = [*sub, str(path)] + (["--text", "t"] if sub == ["eval-ppl"] else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"got {str(path)!r}, which is a file, expected a folder" in err


def test_a_model_given_twice_is_refused(capsys) -> None:
    """``nybble serve A --model B`` used to serve A and drop B without a word."""
    from nybble.cli import main

    assert main(["serve", "/x/a.gguf", "--model", "/x/b"]) == 2
    err = capsys.readouterr().err
    assert "the model is given twice, as MODEL '/x/a.gguf' and as --model '/x/b'" in err
