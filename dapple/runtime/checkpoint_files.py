"""A checkpoint on disk: written beside its path, marked complete last, then swapped in; a load finds the newest.

At every instant the last complete checkpoint can be found::

    save:  P (complete, serial n)                 P.saving (being written)
           P (n)                                  P.saving (complete: marker with serial n + 1, written last)
           P (n + 1)  <- exchanged atomically ->  P.saving (n), then removed           (Linux: renameat2)
     or:   P.replaced (n)                         P.saving (n + 1)     <- where no atomic exchange exists
           P (n + 1)                              P.replaced (n), then removed

A load reads the complete one of P, P.saving and P.replaced with the highest serial; a save first moves that one
to P, so it never removes the last complete checkpoint before a newer one is in place.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "dapple-complete.json"  # written into a checkpoint directory last: {"serial": n, "step": s}
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index, which it writes last
SAVING, REPLACED = ".saving", ".replaced"  # suffixes: the directory a save writes into / the one it replaces
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100  # linux/fs.h, fcntl.h


@dataclass(frozen=True)
class Found:
    """The newest complete checkpoint of a path: ``path`` (the path itself, or beside it), its ``serial``."""

    path: Path
    serial: int
    step: int | None


def saving(target: Path) -> Path:
    return target.with_name(target.name + SAVING)


def replaced(target: Path) -> Path:
    return target.with_name(target.name + REPLACED)


def mark(directory: Path) -> dict | None:
    """The completion marker of ``directory`` (``{"serial", "step"}``), or None where it has none."""
    try:
        with open(directory / MARK) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) and isinstance(doc.get("serial"), int) else None
    except (OSError, ValueError):
        return None


def _complete(directory: Path, unmarked_ok: bool) -> Found | None:
    doc = mark(directory)
    if doc is not None:
        return Found(directory, doc["serial"], doc.get("step"))
    if unmarked_ok and (directory / DCP_METADATA).is_file():  # written before markers existed: serial 0
        return Found(directory, 0, None)
    return None


def newest(target: Path) -> Found | None:
    """The complete checkpoint with the highest serial among ``target``, ``target.saving`` and
    ``target.replaced`` (a tie: the target first); None if there is none. The target itself counts as complete
    without a marker when it has DCP's metadata (a checkpoint written before markers existed)."""
    found = [f for f in (_complete(target, True), _complete(saving(target), False),
                         _complete(replaced(target), False)) if f is not None]
    return max(found, key=lambda f: f.serial) if found else None  # max keeps the first of equals


def missing_message(target: Path) -> str:
    """Why there is no checkpoint at ``target``: what lies beside it."""
    notes = []
    for d in (saving(target), replaced(target)):
        if d.exists():
            notes.append(f"{d.name} holds an incomplete save (no {MARK})")
    return f"no checkpoint at {target}: the path does not exist" + (f" ({'; '.join(notes)})" if notes else "")


def write_mark(directory: Path, serial: int, step: int) -> None:
    """Mark ``directory`` complete (after everything else in it was written): a file written whole, then renamed."""
    tmp = directory / (MARK + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"serial": serial, "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    rename(tmp, directory / MARK)
    _sync_dir(directory)


def promote(target: Path) -> int:
    """Before a save (one process): make the newest complete checkpoint ``target`` and remove what else lies
    beside it (incomplete saves, older checkpoints); returns the serial the new save gets."""
    found = newest(target)
    if found is not None and found.path != target:
        swap_in(target, found.path)  # the newer one in place first; the target (if any) is older
    for d in (saving(target), replaced(target)):
        if d.exists():
            remove(d)
    return (found.serial if found is not None else 0) + 1


def swap_in(target: Path, new: Path) -> None:
    """Move the complete checkpoint ``new`` to ``target`` and remove the one it replaces, so that ``target`` is
    newest at every instant (see the module's docstring)."""
    old = replaced(target)
    if target.exists():
        if exchange(new, target):  # atomic: target is the new one, ``new`` the old one
            remove(new)
            return
        if old.exists() and old != new:
            remove(old)  # older than the target (promote keeps the newest)
        if old != new:
            rename(target, old)
    rename(new, target)
    if old.exists():
        remove(old)
    _sync_dir(target.parent)


def remove(directory: Path) -> None:
    """Delete a checkpoint directory, its marker first (a half-deleted one must not look complete)."""
    try:
        (directory / MARK).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(directory)


def rename(src: Path, dst: Path) -> None:
    """``os.rename`` (the one place a checkpoint directory moves, so tests can interrupt it)."""
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is unavailable
    (another OS, an old C library, a file system without it), and nothing moved."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def _sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable where the OS allows opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_shards(path: Path, storage: dict, keys: set[str], who: str) -> None:
    """Every file DCP will read for ``keys`` (``storage``: DCP metadata's ``storage_data``) exists under ``path``
    and holds the bytes the metadata places there; ValueError naming the file, the keys and ``who`` otherwise."""
    need: dict[str, tuple[int, list[str]]] = {}  # file -> (bytes it must have, keys read from it)
    for index, info in storage.items():
        if index.fqn in keys:
            end, names = need.get(info.relative_path, (0, []))
            need[info.relative_path] = (max(end, info.offset + info.length), names + [index.fqn])
    for name, (end, names) in sorted(need.items()):
        file = path / name
        shown = ", ".join(repr(n) for n in sorted(set(names))[:3]) + (" ..." if len(set(names)) > 3 else "")
        if not file.is_file():
            raise ValueError(f"{who}: damaged checkpoint: {file} is missing (it holds {shown}); nothing was loaded")
        size = file.stat().st_size
        if size < end:
            raise ValueError(f"{who}: damaged checkpoint: {file} has {size} bytes, its metadata needs {end} "
                             f"(truncated? it holds {shown}); nothing was loaded")
