"""The runtime's and profiler's modules import each other without loops and without each other's private names."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dapple"
PARTS = ("runtime", "profiler")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of every ``from ... import`` in ``path``, at any depth of the file."""
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package the module is in
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((module, [a.name for a in node.names]))
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the runtime/profiler modules it imports (a ``from pkg import mod`` counts as importing mod)."""
    files = {_module(p): p for part in PARTS for p in (PACKAGE / part).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, path in files.items():
        for module, names in _imports(path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in files] or [module]
            graph[m].update(t for t in targets if t in files and t != m)
    return graph


def test_no_import_loops():
    graph, state, loops = _graph(), {}, []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                loops.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not loops, loops


def test_no_private_names_imported_across_modules():
    found = [f"{_module(p)} imports {name} from {module}"
             for part in PARTS for p in sorted((PACKAGE / part).rglob("*.py"))
             for module, names in _imports(p) if module.startswith("dapple.")
             for name in names if name.startswith("_")]
    assert not found, found


def test_the_scan_sees_a_loop_through_a_package_import(tmp_path, monkeypatch):
    pkg = tmp_path / "dapple" / "runtime"
    pkg.mkdir(parents=True)
    (tmp_path / "dapple" / "profiler").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "dapple")
    assert _graph()["dapple.runtime.a"] == {"dapple.runtime.b"}
    assert _graph()["dapple.runtime.b"] == {"dapple.runtime.a"}
