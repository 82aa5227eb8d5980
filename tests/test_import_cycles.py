"""No import circles among nybble's modules: counting the imports inside functions and under
``TYPE_CHECKING`` (which import-linter's layer contracts leave out), and the ``import`` /
``cimport`` statements of the Cython core. A module that needs only a type from a module that
imports it names a ``typing.Protocol`` instead (``nybble.tokenizer.chat_encode.ChatTokenizer``).
"""
from __future__ import annotations

import ast
import os
import shutil

from tests.test_layers import cython_imports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_files(src_root: str, package: str) -> dict[str, list[str]]:
    """Dotted module name -> its source files (``.py``, or ``.pyx`` and ``.pxd``)."""
    found: dict[str, list[str]] = {}
    for folder, dirs, files in os.walk(os.path.join(src_root, package)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext not in (".py", ".pyx", ".pxd"):
                continue
            rel = os.path.relpath(os.path.join(folder, stem), src_root).replace(os.sep, ".")
            found.setdefault(rel.removesuffix(".__init__"), []).append(os.path.join(folder, name))
    return found


def _python_imports(path: str, module: str) -> list[str]:
    """Every module name an ``import`` / ``from ... import`` of a ``.py`` file names, at any
    depth (functions, ``if TYPE_CHECKING:``), relative ones resolved; ``from a import b``
    gives ``a.b`` too (``b`` may be a module)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(src_root: str, package: str = "nybble") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (each named import resolved to the
    longest module name it starts with; a module's imports of itself left out)."""
    files = _module_files(src_root, package)
    graph: dict[str, set[str]] = {}
    for module, paths in files.items():
        names: list[str] = []
        for path in paths:
            if path.endswith(".py"):
                names += _python_imports(path, module)
            else:
                with open(path, encoding="utf-8") as f:
                    names += cython_imports(f.read(), module.rpartition(".")[0])
        targets = set()
        for name in names:
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def _describe(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    return "\n".join(f"{a} -> {b}" for cycle in cycles for a in cycle
                     for b in sorted(graph[a] & set(cycle)))


def test_nybble_has_no_import_cycles() -> None:
    graph = import_graph(ROOT)
    assert "nybble.runtime.scheduler.scheduler" in graph and len(graph) > 200
    cycles = import_cycles(graph)
    assert cycles == [], f"import circles:\n{_describe(graph, cycles)}"


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_circles_through_type_checking_functions_relative_and_cimports_are_found(
        tmp_path) -> None:
    _write(tmp_path, "nybble/__init__.py", "")
    _write(tmp_path, "nybble/a.py", "from nybble.b import B\n")
    _write(tmp_path, "nybble/b.py", "from typing import TYPE_CHECKING\n"
                                    "if TYPE_CHECKING:\n    from nybble.a import A\n")
    _write(tmp_path, "nybble/pkg/__init__.py", "from . import c\n")
    _write(tmp_path, "nybble/pkg/c.py", "def f():\n    from .d import g\n")
    _write(tmp_path, "nybble/pkg/d.py", "import nybble.pkg.e\n")
    _write(tmp_path, "nybble/pkg/e.py", "from nybble import pkg\n")
    _write(tmp_path, "nybble/core/x.pxd", "from nybble.core.y cimport Y\n")
    _write(tmp_path, "nybble/core/y.pyx", "import nybble.core.x as x\n")
    _write(tmp_path, "nybble/core/z.pyx", "from nybble.core.z cimport own\nimport nybble.a\n")
    graph = import_graph(str(tmp_path))
    assert import_cycles(graph) == [["nybble.a", "nybble.b"], ["nybble.core.x", "nybble.core.y"],
                                    ["nybble.pkg", "nybble.pkg.c", "nybble.pkg.d",
                                     "nybble.pkg.e"]]
    assert graph["nybble.core.z"] == {"nybble.a"}


def test_a_circle_added_to_the_real_package_is_found(tmp_path) -> None:
    shutil.copytree(os.path.join(ROOT, "nybble"), tmp_path / "nybble",
                    ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__", "_bundled"))
    with open(tmp_path / "nybble" / "model_files.py", "a", encoding="utf-8") as f:
        f.write("\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                "    from nybble.config import ModelConfig\n")
    graph = import_graph(str(tmp_path))
    cycles = import_cycles(graph)
    assert cycles == [["nybble.config", "nybble.model_files"]], _describe(graph, cycles)
