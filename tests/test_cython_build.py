"""``NYBBLE_CYTHON_DEBUG=1`` really turns bounds checks on: setup.py owns the Cython
directives (the ``.pyx`` / ``.pxd`` headers set only ``language_level``, since a file's header
beats ``cythonize(compiler_directives=...)``), and a module built with setup.py's debug
directives raises ``IndexError`` on an out-of-range memoryview access."""
from __future__ import annotations

import glob
import importlib.util
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "nybble", "**", "*.py[xd]"), recursive=True))


def setup_directives(monkeypatch: pytest.MonkeyPatch, debug: bool) -> dict:
    """The ``compiler_directives`` setup.py passes to ``cythonize`` (it is run with
    ``cythonize`` and ``setup`` replaced by recorders: nothing is built)."""
    import Cython.Build
    import setuptools

    seen: dict = {}

    def record(modules, compiler_directives=None, **kwargs):  # noqa: ANN001, ANN202
        seen.update(compiler_directives or {})
        return modules

    monkeypatch.setattr(Cython.Build, "cythonize", record)
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.setenv("NYBBLE_CYTHON_DEBUG", "1" if debug else "0")
    monkeypatch.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return seen


def _header_directives(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.startswith("# cython:")]
    return [d.split("=")[0].strip() for line in lines for d in line[9:].split(",")]


def test_headers_leave_every_directive_but_language_level_to_setup_py() -> None:
    assert len(SOURCES) >= 10
    for path in SOURCES:
        assert set(_header_directives(path)) <= {"language_level"}, path


def test_setup_py_checks_bounds_only_in_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    release = setup_directives(monkeypatch, debug=False)
    assert release["boundscheck"] is False and release["wraparound"] is False
    debug = setup_directives(monkeypatch, debug=True)
    assert debug["boundscheck"] is True and debug["wraparound"] is True
    assert debug["initializedcheck"] is True


@pytest.mark.slow
def test_a_debug_build_raises_index_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension

    directives = setup_directives(monkeypatch, debug=True)
    src = tmp_path / "probe.pyx"
    src.write_text("# cython: language_level=3\n"   # the project's header convention
                   "def read(long[::1] values, Py_ssize_t i):\n"
                   "    return values[i]\n")
    ext = cythonize([Extension("probe", [str(src)])], compiler_directives=directives,
                    build_dir=str(tmp_path / "c"), quiet=True)
    dist = Distribution({"ext_modules": ext})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    (built,) = glob.glob(str(tmp_path / "lib" / "probe*.so"))
    spec = importlib.util.spec_from_file_location("probe", built)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    import numpy as np

    values = np.arange(4, dtype=np.int_)
    assert probe.read(values, 3) == 3
    with pytest.raises(IndexError):
        probe.read(values, 4)
    with pytest.raises(IndexError):
        probe.read(values, -5)
