"""The package's layers: the import-linter contract in pyproject.toml holds, and no two folders (at any depth,
engine/ and engine/core/ included) import each other.

The contract ([tool.importlinter], `layers`, exhaustive) lists every folder and top-level module of ttsserve
from entrypoints/ down to constants.py: a folder imports only folders below it, and siblings joined by `|`
never import each other. Imports inside functions count (grimp reads them all).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_layers_contract_is_kept() -> None:
    pytest.importorskip("importlinter")
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 kept, 0 broken" in proc.stdout, proc.stdout


def _folder(module: str) -> str:
    """The folder (package) a module lives in, at any depth: ttsserve.engine.core.proc -> ttsserve.engine.core,
    ttsserve.engine.engine -> ttsserve.engine, ttsserve.config -> ttsserve (the top-level modules, constants.py
    to platform.py, form the bottom layer). A package's __init__ belongs to the package itself."""
    parts = module.split(".")
    if REPO.joinpath(*parts).is_dir():
        return module
    return ".".join(parts[:-1])


def folder_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one node of the directed graph `edges` (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_folder_cycles_finds_a_loop() -> None:
    assert folder_cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert folder_cycles({("a", "b"), ("b", "c")}) == []


def test_no_import_cycle_between_folders() -> None:
    grimp = pytest.importorskip("grimp")
    sys.path.insert(0, str(REPO))  # this tree's ttsserve, not an installed one
    try:
        graph = grimp.build_graph("ttsserve", cache_dir=None)
    finally:
        sys.path.remove(str(REPO))
    edges = set()
    for importer in graph.modules - {"ttsserve"}:  # ttsserve/__init__.py re-exports the entry points' names
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = _folder(importer), _folder(imported)
            if a != b:
                edges.add((a, b))
    assert edges, "no imports between folders were read"
    assert folder_cycles(edges) == []
