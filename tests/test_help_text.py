"""Help text says what the code does (issue 27.10): ``plan --help`` does not call tensor
parallelism "computed only" (the engine runs it), and ``quantize --threads`` names the
default the quantizer uses (1 thread, ``threads=args.threads or 1``)."""
from __future__ import annotations

import re

import pytest

from nybble.cli import main


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return re.sub(r"-\s+", "-", re.sub(r"\s+", " ", capsys.readouterr().out))


def test_plan_help_does_not_call_tensor_parallelism_computed_only(capsys) -> None:
    text = _help(capsys, "plan")
    assert "computed only" not in text
    assert "as `nybble serve --tensor-parallel-size` shards it" in text


def test_quantize_threads_help_names_the_default_it_uses(capsys) -> None:
    text = _help(capsys, "quantize")
    assert "(default: 1, so the same inputs give byte-identical files;" in text
    assert "physical cores minus one" not in text
    assert "physical cores minus one" in _help(capsys, "serve")   # the engine's own default
