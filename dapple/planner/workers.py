"""Independent tasks side by side in forked worker processes (the planner is pure Python: threads share one GIL)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence, cast

from ..core.checks import is_int
from . import tuning


def available_memory() -> float:
    """Bytes the system can give without swapping (/proc/meminfo's MemAvailable; inf where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def can_fork() -> bool:
    """Whether workers can be forked: Linux only (macOS can fork, but its system libraries are not fork-safe,
    and spawning a worker would import torch again, seconds each)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def resolve_workers(workers: int | str, searches: int, large: bool) -> int:
    """How many processes run ``searches`` searches: ``workers``, or for "auto" one per core (os.sched_getaffinity)
    up to one per search where ``large`` (the compact search of a large cluster: seconds per size) and workers
    can be forked (not from a daemonic pool worker) and no more than SearchTuning.worker_memory each fit in the
    available memory, else 1 (a fork costs more than a small search)."""
    daemon = multiprocessing.current_process().daemon  # a pool's worker: it may not start processes
    if workers == "auto":
        if not large or not can_fork() or daemon:
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, searches, int(available_memory() // tuning.TUNING.worker_memory)))
    if not is_int(workers, 1):
        raise ValueError(f"workers: expected a positive int or 'auto', got {workers!r}")
    if workers > 1 and not can_fork():
        raise ValueError(f"workers={workers}: the searches run in forked processes, which {sys.platform} does not "
                         f"offer safely; use workers=1")
    if workers > 1 and daemon:
        raise ValueError(f"workers={workers}: this process ({multiprocessing.current_process().name}) is a daemonic "
                         f"pool worker, which may not start processes; use workers=1")
    return min(workers, max(searches, 1))


def forked_map(task: Callable, items: Sequence, workers: int, what: str = "") -> list:
    """[task(item) for item in items], in order, ``workers`` forked processes at a time where workers > 1 (each
    inherits ``task`` and ``items``; only the results are pickled back).

    Raises:
        RuntimeError: a worker died, or the workers used no CPU for SearchTuning.worker_stuck seconds while items
            were pending (stuck: they are ended), naming ``what`` they were doing; not a hang.
        Exception: what a task raised in a worker.
    """
    if workers <= 1 or len(items) <= 1:
        return [task(item) for item in items]
    pool = _Pool(task, list(items), min(workers, len(items)))
    try:
        return pool.results(f"in {what} with {workers} workers")
    finally:
        pool.close()


def _apply(task: Callable, item: Any) -> Any:
    """In a worker: the task on one item (a test replaces it with one that dies or hangs)."""
    return task(item)


def _serve(task: Callable, items: list, conn: Connection) -> None:
    """A worker's loop: the index of an item in, its result out, until None. SIGTERM ends it whatever handler the
    parent installed (a launcher's handler that raises would be caught here, and the worker would wait again)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while (i := _next(conn)) is not None:
        try:
            out: tuple[bool, Any, str | None] = (True, _apply(task, items[i]), None)
        except Exception as e:  # raised in the parent, with this traceback
            out = (False, e, traceback.format_exc())
        try:
            conn.send(out)
        except Exception:  # (an exception that does not pickle)
            conn.send((False, RuntimeError(repr(out[1])), out[2]))


def _next(conn: Connection) -> int | None:
    """The next index the parent sends (None: stop, or the parent is gone)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


class _RemoteTraceback(Exception):
    """Where a task raised in its worker (the cause of the exception forked_map raises)."""


class _Pool:
    """``n`` forked workers over ``items``, each fed the next item's index as it returns a result (in order)."""

    def __init__(self, task: Callable, items: list, n: int):
        ctx = multiprocessing.get_context("fork")
        self.items, self.procs, self.conns = items, [], []
        for _ in range(n):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(task, items, there), daemon=True)
            proc.start()
            there.close()  # (the worker's end: EOF here once it exits)
            self.procs.append(proc)
            self.conns.append(here)
        self.done = False  # every result came back: the workers are told to stop, not ended

    def results(self, doing: str) -> list:
        items = self.items
        out: list = [None] * len(items)
        order = iter(range(len(items)))
        busy: dict[Connection, int] = {}  # connection -> the index of its item

        def feed(conn: Connection) -> None:
            i = next(order, None)
            if i is not None:
                busy[conn] = i
                conn.send(i)
        for conn in self.conns:
            feed(conn)
        used, since, left = None, time.monotonic(), len(items)
        while busy:
            for conn in cast(list[Connection], wait(list(busy), timeout=tuning.TUNING.poll)):  # busy's own
                i = busy.pop(conn)
                try:
                    ok, value, where = conn.recv()
                except (EOFError, OSError) as e:
                    raise RuntimeError(f"a planner worker process died (out of memory?) {doing}; retry with "
                                       f"workers=1") from e
                if not ok:
                    raise value from _RemoteTraceback(where)
                out[i], left = value, left - 1
                feed(conn)
            cpu, now = self.cpu_seconds(), time.monotonic()
            if cpu is None or cpu != used:  # progress (or no way to tell: never stuck)
                used, since = cpu, now
            elif now - since > tuning.TUNING.worker_stuck:
                raise RuntimeError(f"planner workers used no CPU for {now - since:.0f} s {doing}, {left} of "
                                   f"{len(items)} items left (stuck: forking a multi-threaded process can deadlock); "
                                   f"retry with workers=1")
        self.done = True
        return out

    def cpu_seconds(self) -> float | None:
        """CPU seconds the workers used so far (/proc/PID/stat: user + system), None where unknown."""
        ticks = 0
        try:
            for proc in self.procs:
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
                ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
        except (OSError, ValueError, IndexError):
            return None
        return ticks / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Ends the workers: told to stop once every result came back, else (an error, stuck) ended at once."""
        for conn in self.conns:
            try:
                if self.done:
                    conn.send(None)
            except OSError:
                pass  # (it died)
            conn.close()
        for proc in self.procs:
            proc.join(5 if self.done else 0)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(2)
            if proc.is_alive():  # one that caught SIGTERM before it set the default handler
                proc.kill()
                proc.join(5)
