"""``nybble quantize`` entry checks: an output folder that is (or is inside) the source folder is
refused before anything is written; a run that would quantize nothing exits non-zero, says
why and writes nothing; the weights it writes get the usual file mode (0644 under umask 022),
not safetensors' 0600."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from nybble.cli import main
from nybble.config import DEFAULT_MODEL


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    """A private copy of the bundled model (the test must never risk the real one)."""
    folder = tmp_path / "src"
    shutil.copytree(DEFAULT_MODEL, folder)
    return folder


@pytest.fixture()
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("out", [".", "sub", "sub/deeper", "./../src"])
def test_out_in_the_source_folder_is_refused_before_writing(
        source: Path, capsys: pytest.CaptureFixture[str], out: str) -> None:
    before = _digest(source)
    target = str(source / out)
    assert main(["quantize", str(source), "--method", "rtn", "--out", target]) == 2
    err = capsys.readouterr().err
    assert "--out must be a folder outside the source model folder" in err
    assert _digest(source) == before   # nothing written, nothing created


def test_out_that_is_a_file_is_refused(source: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "out.txt"
    a_file.write_text("keep me")
    assert main(["quantize", str(source), "--method", "rtn", "--out", str(a_file)]) == 2
    assert "--out must be a folder, got" in capsys.readouterr().err
    assert a_file.read_text() == "keep me"


def test_a_run_that_quantizes_nothing_fails_and_writes_nothing(
        source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q"
    # stories260k: every linear has input width 64 or 172, neither a multiple of 7, and no
    # multiple of 8 below 7 exists to fall back to
    assert main(["quantize", str(source), "--method", "rtn", "--group-size", "7",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nothing to quantize: all 35 linear layers would stay dense" in err
    assert "input width 64 is not a multiple of group_size 7" in err
    assert not out.exists()


def test_written_files_have_the_usual_mode(source: Path, tmp_path: Path, umask_022: None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q"
    assert main(["quantize", str(source), "--method", "rtn", "--group-size", "32",
                 "--allow-unquantized", "--out", str(out)]) == 0
    capsys.readouterr()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644
    assert set(modes.values()) == {0o644}, modes


def test_a_gguf_file_is_refused_with_what_to_do(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF file is already quantized: one line that says so (it used to fail on
    'Not a directory: .../model.gguf/config.json')."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["quantize", str(gguf), "--method", "rtn", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "reads a Hugging Face folder of float weights, got the GGUF file" in err
    assert f"nybble serve {gguf}" in err and "Traceback" not in err
    assert not (tmp_path / "q").exists()
