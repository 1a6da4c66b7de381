"""The micro-batch sizes' searches side by side in forked worker processes (pure Python: threads share one GIL)."""

from __future__ import annotations

import multiprocessing
import signal
import os
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from enum import Enum
from typing import TYPE_CHECKING, Callable, Sequence

from ...core.checks import is_int

if TYPE_CHECKING:
    from .dp import DPSearch
    from .records import Outcome

_RUNNING: tuple = ()  # (task, items) of the running call: a forked worker inherits them (lambdas too), unpickled
WORKER_MEMORY = 2e9  # bytes a worker may need: workers="auto" starts no more than fit (128 x 8 at 60 s: 1.4 GB)
_LOCK = threading.Lock()  # one call at a time sets them (plan() from two threads)
# seconds of in-process work from which workers="auto" forks the steps of a full search as well (dapple.plan: the
# searches once the seeds took this long, the candidates' simulations once the first took this long / the rest)
FORK_WORTH = 0.1
# seconds in which no worker of a step used any CPU, with work still pending, after which the workers count as
# stuck (a fork of a multi-threaded process, e.g. a notebook's kernel, can deadlock on a lock another thread held):
# a searching worker uses a core the whole time, however long the search, so only a stuck one is stopped
WORKER_STUCK = 30.0
POLL = 1.0  # seconds between looks at the workers' CPU time


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
    can be forked (not from a daemonic pool worker) and no more than WORKER_MEMORY each fit in the available
    memory, else 1 (a fork costs more than a small search)."""
    daemon = multiprocessing.current_process().daemon  # a pool's worker: it may not start processes
    if workers == "auto":
        if not large or not can_fork() or daemon:
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, searches, int(available_memory() // WORKER_MEMORY)))
    if not is_int(workers, 1):
        raise ValueError(f"workers: expected a positive int or 'auto', got {workers!r}")
    if workers > 1 and not can_fork():
        raise ValueError(f"workers={workers}: the searches run in forked processes, which {sys.platform} does not "
                         f"offer safely; use workers=1")
    if workers > 1 and daemon:
        raise ValueError(f"workers={workers}: this process ({multiprocessing.current_process().name}) is a daemonic "
                         f"pool worker, which may not start processes; use workers=1")
    return min(workers, max(searches, 1))


def _default_signals() -> None:
    """In a new worker: SIGTERM ends it, whatever handler the parent installed (a launcher's handler that raises
    would be caught by the worker's result loop, which then waits on its queue again: unkillable but by SIGKILL)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _apply(i: int):
    """In a worker: the running call's task on its i-th item."""
    task, items = _RUNNING
    return task(items[i])


def forked_map(task: Callable, items: Sequence, workers: int, what: str = "") -> list:
    """[task(item) for item in items], ``workers`` processes at a time where workers > 1 (forked: they inherit
    ``task`` and ``items``; only the results are pickled back), in order. A worker that dies, or workers that use
    no CPU for WORKER_STUCK seconds while items are pending (stuck), are a RuntimeError naming ``what`` they were
    doing, not a hang (stuck workers are ended)."""
    global _RUNNING
    if workers <= 1 or len(items) <= 1:
        return [task(item) for item in items]
    with _LOCK:
        _RUNNING = (task, list(items))
        pool = ProcessPoolExecutor(max_workers=min(workers, len(items)), mp_context=multiprocessing.get_context("fork"),
                                   initializer=_default_signals)
        stuck = False
        try:
            futures = [pool.submit(_apply, i) for i in range(len(items))]
            used, since = None, time.monotonic()
            while True:
                _, pending = wait(futures, timeout=POLL, return_when=FIRST_EXCEPTION)
                if not pending or any(f.done() and f.exception() is not None for f in futures):
                    break
                cpu, now = _cpu_seconds(pool), time.monotonic()
                if cpu is None or cpu != used:  # progress (or no way to tell: never stuck)
                    used, since = cpu, now
                elif now - since > WORKER_STUCK:
                    stuck = True
                    _stop(pool)
                    raise RuntimeError(f"planner workers used no CPU for {now - since:.0f} s in {what} with "
                                       f"{workers} workers, {len(pending)} of {len(items)} items left (stuck: "
                                       f"forking a multi-threaded process can deadlock); retry with workers=1")
            return [f.result() for f in futures]
        except BrokenProcessPool as e:
            raise RuntimeError(f"a planner worker process died (out of memory?) in {what} with {workers} workers; "
                               f"retry with workers=1") from e
        finally:
            pool.shutdown(wait=not stuck, cancel_futures=True)
            _RUNNING = ()


def _cpu_seconds(pool: ProcessPoolExecutor) -> float | None:
    """CPU seconds the worker processes of ``pool`` used so far (/proc/PID/stat: user + system), None where
    unknown."""
    procs = getattr(pool, "_processes", None)
    if not procs:
        return None
    ticks = 0
    try:
        for pid in list(procs):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def _stop(pool: ProcessPoolExecutor) -> None:
    """Ends the worker processes of ``pool`` (Python 3.14's terminate_workers where there is one)."""
    stop = getattr(pool, "terminate_workers", None)
    if stop is not None:
        stop()
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(2)
    for proc in procs:  # one that caught SIGTERM and went back to waiting on a lock its sibling held
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class Step(str, Enum):
    """A step of a micro-batch size's search that workers can take (DPSearch's method of the same name)."""

    SEED = "seed"
    REFINE_SEEDS = "refine_seeds"
    BOUND_TABLES = "bound_tables"
    RUN = "run"


def take(search: "DPSearch", step: Step) -> "Outcome":
    """``step`` on ``search``: its outcome, what a worker sends back (DPSearch.adopt takes it in the parent)."""
    if step is Step.SEED:
        return search.seed()
    if step is Step.REFINE_SEEDS:
        return search.refine_seeds()
    if step is Step.BOUND_TABLES:
        return search.bound_tables()
    return search.run()


def in_workers(searches: Sequence["DPSearch"], workers: int, step: Step | str,
               accept: Callable[["DPSearch", "Outcome"], bool] | None = None) -> None:
    """``step`` for every search in ``searches``, ``workers`` at a time, in order (the most promising first), each
    search adopting its outcome where ``accept(search, outcome)``, asked in order, does not say False (the search
    then stays as it was). Every search keeps the incumbent it was given (they share none while running: the plan
    does not depend on timing or on the number of workers)."""
    step = Step(step)
    what = f"{step.value}() of micro-batch sizes {[search.b for search in searches]}"
    for search, outcome in zip(searches, forked_map(lambda search: take(search, step), searches, workers, what)):
        if accept is not None and not accept(search, outcome):
            continue
        search.adopt(outcome)
