"""The planner reads no private attribute of another object, module or library (a pool's ``_processes``, another
module's ``_helper``): what it uses of multiprocessing, numpy or its own modules is their public surface."""

from __future__ import annotations

import ast
from pathlib import Path

import dapple.planner

PLANNER = Path(dapple.planner.__file__).parent
PUBLIC = {"_replace", "_make", "_fields", "_asdict"}  # NamedTuple's public methods (underscored against field names)


def private_uses(path: Path) -> list[str]:
    """Each ``x._name`` (x not self or cls) and ``from m import _name`` in a module, as 'file:line: what'."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if node.attr not in PUBLIC and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                out.append(f"{path.name}:{node.lineno}: {ast.unparse(owner)}.{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_the_planner_uses_no_private_name_of_another_object():
    found = [use for path in sorted(PLANNER.rglob("*.py")) for use in private_uses(path)]
    assert not found, found


def test_the_scan_sees_private_attributes_and_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from x import _y\n\n\ndef g(pool, t):\n    self._ok, t._replace()\n    return pool._processes\n")
    assert private_uses(f) == ["m.py:1: from x import _y", "m.py:6: pool._processes"]
