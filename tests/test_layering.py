"""The layering of docs/design.md: core imports no phase; profiler, planner and runtime meet only in core."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dapple"
FORBIDDEN = {"core": ("profiler", "planner", "runtime", "cli", "calibration"),
             "profiler": ("planner", "runtime", "cli", "calibration"),
             "planner": ("profiler", "runtime", "cli", "calibration"), "runtime": ("planner", "cli", "calibration"),
             "calibration": ("profiler", "runtime", "cli")}
# Cluster.local measures this machine's links with the profiler's probe (imported when it measures, so the document
# itself needs no torch)
ALLOWED = {"dapple/core/cluster.py": {"profiler"}}


def imported_parts(path: Path, part: str) -> set[str]:
    """The dapple sub-packages a module of ``part`` imports, relative or absolute, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            elif node.level == 1:  # from .x: inside the same sub-package
                names = [f"dapple.{part}.{node.module or ''}"]
            else:  # from ..x import y (level 2: the dapple package)
                names = [f"dapple.{node.module}"] if node.module else [f"dapple.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == "dapple" and len(bits) > 1:
                found.add(bits[1])
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_sub_packages_depend_only_downward(part):
    offenders = {f"{path.relative_to(PACKAGE.parent)} imports dapple.{other}"
                 for path in sorted((PACKAGE / part).rglob("*.py"))
                 for other in imported_parts(path, part) & set(FORBIDDEN[part])
                 if other not in ALLOWED.get(str(path.relative_to(PACKAGE.parent)), ())}
    assert not offenders, sorted(offenders)


def test_the_scan_sees_relative_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from ..runtime.comm import P2P\nfrom .. import _io\nimport dapple.planner.plan\n")
    assert imported_parts(f, "profiler") == {"runtime", "_io", "planner"}
