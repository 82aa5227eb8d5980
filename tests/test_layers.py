"""Layers point down only: the import-linter contracts of pyproject.toml hold, have no
exceptions, and do fail on an upward import; every module of the torch-free packages is pinned
by a torch-free contract; the Cython core (which import-linter cannot read) names no torch and
no nybble module above it."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tokenize
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")
CORE = os.path.join(ROOT, "nybble", "runtime", "scheduler")


def _contracts() -> list[dict]:
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def _lint_imports(cwd: str, pythonpath: str) -> subprocess.CompletedProcess:
    """``lint-imports`` with the repository's contracts, run in ``cwd``; ``pythonpath`` (first
    on the path) decides which ``nybble`` package is analysed."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", PYPROJECT],
                          cwd=cwd, env=env, capture_output=True, text=True, check=False,
                          timeout=300)


def test_import_contracts_hold() -> None:
    proc = _lint_imports(ROOT, ROOT)
    assert proc.returncode == 0, f"lint-imports failed:\n{proc.stdout}\n{proc.stderr}"
    assert "0 broken" in proc.stdout


def test_contracts_pin_every_layer_without_exceptions() -> None:
    contracts = {c["id"]: c for c in _contracts()}
    assert set(contracts) == {"layers", "runtime-layers", "torch-free-core", "torch-free-api"}
    for c in contracts.values():
        assert not c.get("ignore_imports"), f"contract {c['id']} lists exceptions"
    layers = contracts["layers"]
    assert layers["exhaustive"] is True and not layers.get("exhaustive_ignores")
    flat = [m.strip() for layer in layers["layers"] for m in layer.split("|")]
    order = ["server", "runtime", "models", "quant", "kernels"]
    assert [flat.index(m) for m in order] == sorted(flat.index(m) for m in order)
    for top in ("server", "bench", "quantize", "generate_cli"):
        assert flat.index(top) < flat.index("runtime")


TORCH_FREE_PACKAGES = ("nybble.runtime.scheduler", "nybble.runtime.frontend", "nybble.tokenizer")
"""Packages whose every module is pinned torch-free (the Cython core's Python side, the API
process's half of the runtime, the text handling the API process uses)."""
NOT_TORCH_FREE = {"nybble.tokenizer.hf_tokenizer"}  # transformers' conversion: engine core only


def _package_modules(package: str) -> dict[str, str]:
    """Dotted name -> path of every ``.py`` module of ``package`` (its ``__init__`` too)."""
    folder = os.path.join(ROOT, *package.split("."))
    found = {}
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name[:-3]), ROOT)
                found[rel.replace(os.sep, ".").removesuffix(".__init__")] = \
                    os.path.join(dirpath, name)
    return found


def test_torch_free_packages_are_pinned_module_by_module() -> None:
    torch_free = [c for c in _contracts() if c["type"] == "forbidden"
                  and "torch" in c["forbidden_modules"]]
    exact = {m for c in torch_free for m in c["source_modules"]}
    trees = {m for c in torch_free if c.get("as_packages", True) for m in c["source_modules"]}
    unpinned = []
    for package in TORCH_FREE_PACKAGES:
        for module, path in sorted(_package_modules(package).items()):
            with open(path, encoding="utf-8") as f:
                imports_nothing = "import" not in f.read()  # a docstring-only package init
            covered = module in exact or any(module.startswith(t + ".") for t in trees)
            if not (covered or imports_nothing or module in NOT_TORCH_FREE):
                unpinned.append(module)
    assert not unpinned, f"modules in no torch-free contract of pyproject.toml: {unpinned}"


def _copy_package(dst: str) -> str:
    """The ``nybble`` sources (``.py`` only) under ``dst``; returns the package folder."""
    pkg = os.path.join(dst, "nybble")
    shutil.copytree(os.path.join(ROOT, "nybble"), pkg,
                    ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__", "_bundled"))
    return pkg


def test_contracts_fail_on_upward_imports(tmp_path) -> None:
    pkg = _copy_package(str(tmp_path))
    assert _lint_imports(str(tmp_path), str(tmp_path)).returncode == 0  # the copy is clean
    with open(os.path.join(pkg, "kernels", "_upward.py"), "w") as f:
        f.write("from nybble.models import linear\n")
    with open(os.path.join(pkg, "quantize", "_sibling.py"), "w") as f:
        f.write("import nybble.server.app\n")
    with open(os.path.join(pkg, "runtime", "scheduler", "batch.py"), "a") as f:
        f.write("\nimport torch\n")
    with open(os.path.join(pkg, "_unlayered.py"), "w") as f:
        f.write("X = 1\n")
    with open(os.path.join(pkg, "tokenizer", "tokenizer.py"), "a") as f:
        f.write("\ndef _convert():\n    from nybble.tokenizer import hf_tokenizer\n")
    with open(os.path.join(pkg, "runtime", "engine", "beam_search.py"), "a") as f:
        f.write("\nimport nybble.runtime.frontend.request\n")  # across the process boundary
    proc = _lint_imports(str(tmp_path), str(tmp_path))
    out = " ".join(proc.stdout.split())  # the report wraps long lines
    assert proc.returncode == 1, out
    assert "0 kept, 4 broken" in out
    assert "nybble.runtime.engine.beam_search -> nybble.runtime.frontend.request" in out
    assert "nybble.tokenizer.tokenizer -> nybble.tokenizer.hf_tokenizer" in out
    assert "nybble.kernels._upward -> nybble.models.linear" in out
    assert "nybble.quantize._sibling -> nybble.server.app" in out
    assert "nybble.runtime.scheduler.batch -> torch" in out
    assert "nybble._unlayered" in out


_IMPORT_WORDS = ("import", "cimport", "from")


def cython_imports(source: str, package: str = "nybble.runtime.scheduler") -> list[str]:
    """Modules named by the ``import`` / ``cimport`` / ``from ... (c)import`` statements of a
    ``.pyx`` / ``.pxd`` source, relative ones resolved against ``package``. Strings (docstrings)
    and comments are tokens of their own, so prose that mentions imports is not counted."""
    statements: list[list[tokenize.TokenInfo]] = [[]]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            statements.append([])
        elif tok.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            statements[-1].append(tok)
    found: list[str] = []
    for stmt in statements:
        words = [t.string for t in stmt]
        if not words or words[0] not in _IMPORT_WORDS:
            continue
        if words[0] != "from":  # import a.b as c, d
            found += ["".join(seg.split(" as ")[0].split())
                      for seg in " ".join(words[1:]).split(",")]
            continue
        end = next(i for i, w in enumerate(words) if w in ("import", "cimport"))
        name = "".join(words[1:end])
        rel = name.lstrip(".")
        level = len(name) - len(rel)
        if level:  # from .x / from ..x / from . import x
            base = package.rsplit(".", level - 1)[0] if level > 1 else package
            name = f"{base}.{rel}" if rel else base
        found.append(name)
    return found


def core_violations(sources: dict[str, str], allowed: set[str]) -> list[str]:
    """``"file: module"`` for every torch module, and every nybble module not in ``allowed``,
    that the Cython sources (file name -> text) import."""
    bad = []
    for fname, text in sorted(sources.items()):
        for name in cython_imports(text):
            top = name.split(".")[0]
            if top == "torch" or (top == "nybble" and name not in allowed):
                bad.append(f"{fname}: {name}")
    return bad


def test_cython_import_scanner() -> None:
    src = ('"""Docstring: import torch here would be prose.\nfrom nybble.models import x\n"""\n'
           "from libc.stdint cimport int32_t  # import torch in a comment\n"
           "cimport numpy as cnp\n"
           "import numpy as np, nybble.kernels\n"
           "from nybble.runtime.scheduler.batch import (\n    ScheduledBatch,\n)\n"
           "from .sequence cimport SlotStore\n"
           "def f():\n    import torch.nn\n")
    assert cython_imports(src) == ["libc.stdint", "numpy", "numpy", "nybble.kernels",
                                   "nybble.runtime.scheduler.batch",
                                   "nybble.runtime.scheduler.sequence", "torch.nn"]
    allowed = {"nybble.runtime.scheduler.batch", "nybble.runtime.scheduler.sequence"}
    assert core_violations({"x.pyx": src}, allowed) == ["x.pyx: nybble.kernels",
                                                         "x.pyx: torch.nn"]


def test_cython_core_imports_no_torch_and_nothing_above_it() -> None:
    files = sorted(f for f in os.listdir(CORE) if f.endswith((".pyx", ".pxd")))
    assert len(files) >= 5
    core = {f"nybble.runtime.scheduler.{f.rsplit('.', 1)[0]}" for f in files}
    (torch_free,) = [c for c in _contracts() if c["id"] == "torch-free-core"]
    assert torch_free["forbidden_modules"] == ["torch"]
    allowed = core | set(torch_free["source_modules"])
    sources = {}
    for fname in files:
        with open(os.path.join(CORE, fname), encoding="utf-8") as f:
            sources[fname] = f.read()
    bad = core_violations(sources, allowed)
    assert not bad, ("the Cython core may import only torch-free modules pinned by the "
                     f"'torch-free-core' contract ({sorted(allowed)}), got {bad}")
