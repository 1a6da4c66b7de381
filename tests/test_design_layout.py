"""docs/design.md's layout names every module of the package, and no module that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = re.compile(r"^( *)(\S+/)(?:\s|$)")  # a line that opens a folder: "dapple/core/" or, indented, "probe/"
MODULE = re.compile(r"\b([\w/]*\w\.py)\b")


def layout_block(design: str) -> str:
    """The first code block of the "## Layout and layering" section."""
    section = design.split("## Layout and layering", 1)[1]
    return section.split("```", 2)[1]


def named_modules(block: str) -> set[str]:
    """The modules the layout names, as paths from the repository root: a folder line ("dapple/core/", or indented
    "probe/" under the folder line above it) and the lines below it up to the next folder name its modules; a line
    may name a file by its whole path ("dapple/__init__.py")."""
    out: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, path) of the open folders, outermost first
    for line in block.splitlines():
        opened = FOLDER.match(line)
        if opened:
            indent, name = len(opened.group(1)), opened.group(2)
            while folders and folders[-1][0] >= indent:
                folders.pop()
            folders.append((indent, name if name.startswith("dapple/") or not folders else folders[-1][1] + name))
            line = line[opened.end():]
        for name in MODULE.findall(line):
            if name.startswith("dapple/"):
                out.add(name)
            elif folders:
                out.add(folders[-1][1] + name)
    return out


def package_modules(root: Path = ROOT) -> set[str]:
    """Every module under dapple/ as a path from the root; a sub-package's ``__init__.py`` is optional."""
    out = set()
    for path in (root / "dapple").rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if path.name == "__init__.py" and rel != "dapple/__init__.py":
            continue
        out.add(rel)
    return out


def test_the_layout_names_every_module_and_only_those():
    named = named_modules(layout_block((ROOT / "docs" / "design.md").read_text()))
    modules = package_modules()
    optional = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dapple").rglob("__init__.py")}
    missing, stale = sorted(modules - named), sorted(named - modules - optional)
    assert not missing, (f"docs/design.md's layout (## Layout and layering) does not name {len(missing)} module(s): "
                         f"{', '.join(missing)}; add each to the line of its folder")
    assert not stale, f"docs/design.md's layout names module(s) that do not exist: {', '.join(stale)}"


def test_the_parse_reads_folders_and_their_lines():
    block = ("dapple/__init__.py   the API\n"
             "dapple/core/         plan.py (+ plan_table.py), schedule.py\n"
             "                     checks.py\n"
             "dapple/planner/      planning.py\n"
             "  search/            dp.py, memo.py\n"
             "                     seeds.py\n"
             "  model/             cost.py\n")
    assert named_modules(block) == {"dapple/__init__.py", "dapple/core/plan.py", "dapple/core/plan_table.py",
                                    "dapple/core/schedule.py", "dapple/core/checks.py", "dapple/planner/planning.py",
                                    "dapple/planner/search/dp.py", "dapple/planner/search/memo.py",
                                    "dapple/planner/search/seeds.py", "dapple/planner/model/cost.py"}


def test_a_module_missing_from_the_layout_is_named(tmp_path):
    (tmp_path / "dapple" / "runtime").mkdir(parents=True)
    for name in ("__init__.py", "runtime/__init__.py", "runtime/engine.py", "runtime/agreement.py"):
        (tmp_path / "dapple" / name).write_text("")
    named = named_modules("dapple/__init__.py\ndapple/runtime/   engine.py\n")
    assert package_modules(tmp_path) - named == {"dapple/runtime/agreement.py"}
