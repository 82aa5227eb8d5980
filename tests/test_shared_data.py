"""Without the shared data folder the suite still collects: the tests that need it are skipped
with a reason that names the missing path (``shared_path`` / ``shared_folders`` in
conftest.py), none crashes collection."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_suite_collects_and_skips_without_the_shared_folder(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    env = {**os.environ, "NYBBLE_SHARED": str(absent)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
         "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert "collected" in summary and "error" not in summary, out[-4000:]
    assert f"needs the shared data folder: {absent}/fixtures/quant is missing" in out
    assert f"needs the shared data folder: {absent}/models/stories3m is missing" in out
    assert "shared-data-missing" in out   # the parametrized cases say so too
