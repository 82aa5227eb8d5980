"""Start-up imports of ``nybble serve``: the API process spawns the engine core before any
heavy import, and the core imports only what serving a plain request needs; start-up runs with
the garbage collector paused and leaves it on (with the start-up heap frozen)."""
from __future__ import annotations

import contextlib
import gc
import subprocess
import sys

import pytest

from nybble.startup_gc import startup_gc_paused


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_serve_spawns_the_core_before_heavy_imports() -> None:
    # The core's torch import is the critical path: every import before the spawn delays it.
    code = ("import subprocess, sys\n"
            "class Spawned(Exception):\n"
            "    pass\n"
            "def popen(cmd, **kwargs):\n"
            "    assert cmd[1:3] == ['-m', 'nybble.runtime.engine.core_process'], cmd\n"
            "    print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
            "    raise Spawned\n"
            "subprocess.Popen = popen\n"
            "from nybble.cli import main\n"
            "try:\n"
            "    main(['serve', '--port', '0'])\n"
            "except Spawned:\n"
            "    pass\n")
    loaded = set(_run(code).split())
    assert "msgspec" in loaded  # NOTE: the probe saw the spawn (the config is encoded)
    heavy = {"asyncio", "zmq", "uvicorn", "fastapi", "starlette", "pydantic", "tokenizers",
             "jinja2", "prometheus_client", "numpy", "torch", "transformers"}
    assert not loaded & heavy, sorted(loaded & heavy)


def test_engine_core_start_up_and_first_step_import_only_what_they_need() -> None:
    # The bundled model has tokenizer.json: no transformers; a plain greedy request needs no
    # grammar (xgrammar), no JSON schema, no web stack, no tokenizer (the API process's job).
    code = ("import gc, sys, time\n"
            "from nybble import SamplingParams\n"
            "from nybble.config import EngineConfig, encode_config\n"
            "from nybble.runtime.engine.core_process import _start\n"
            "from nybble.runtime.messages import EngineCoreRequest\n"
            "core, ready = _start(encode_config(EngineConfig()))\n"
            "assert gc.isenabled() and gc.get_freeze_count() > 0\n"
            "core.add_request(EngineCoreRequest('r', [1, 403, 90], SamplingParams(max_tokens=1),"
            " [2], time.monotonic()))\n"
            "out = core.step()\n"
            "assert out is not None and out.request_ids == ['r'], out\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n")
    loaded = set(_run(code).split())
    assert "torch" in loaded
    unneeded = {"transformers", "sympy", "xgrammar", "jsonschema", "fastapi", "starlette",
                "uvicorn", "pydantic", "prometheus_client", "jinja2", "tokenizers", "httpx"}
    assert not loaded & unneeded, sorted(loaded & unneeded)


@pytest.mark.parametrize("enabled_before", [True, False])
@pytest.mark.parametrize("raises", [False, True])
def test_startup_gc_paused_restores_the_collector(enabled_before: bool, raises: bool) -> None:
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    frozen = gc.get_freeze_count()
    kept = [[] for _ in range(100)]  # NOTE: tracked objects alive at the freeze
    try:
        expected = pytest.raises(RuntimeError) if raises else contextlib.nullcontext()
        with expected, startup_gc_paused():
            assert not gc.isenabled()
            if raises:
                raise RuntimeError("start-up failed")
        assert gc.isenabled() is enabled_before
        assert gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()

