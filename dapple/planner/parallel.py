"""The micro-batch sizes' searches side by side in forked worker processes (pure Python: threads share one GIL)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Sequence

from .._checks import is_int

if TYPE_CHECKING:
    from .search import _DP

_JOBS: list = []  # the searches of the running call: a forked worker inherits them, nothing is pickled to it


def can_fork() -> bool:
    """Whether workers can be forked: Linux only (macOS can fork, but its system libraries are not fork-safe,
    and spawning a worker would import torch again, seconds each)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def resolve_workers(workers: int | str, searches: int, large: bool) -> int:
    """How many processes run ``searches`` searches: ``workers``, or for "auto" one per core (os.sched_getaffinity)
    up to one per search where ``large`` (the compact search of a large cluster: seconds per size) and workers
    can be forked, else 1 (a fork costs more than a small search)."""
    if workers == "auto":
        if not large or not can_fork():
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cores, searches))
    if not is_int(workers, 1):
        raise ValueError(f"workers: expected a positive int or 'auto', got {workers!r}")
    if workers > 1 and not can_fork():
        raise ValueError(f"workers={workers}: the searches run in forked processes, which {sys.platform} does not "
                         f"offer safely; use workers=1")
    return min(workers, max(searches, 1))


def _run(i: int) -> tuple:
    """In a worker: search ``_JOBS[i]`` and return what plan() reads of it."""
    dp = _JOBS[i]
    dp.run()
    return dp.best, dp.states, dp.transitions, dp.complete, dp.root_bound


def run_searches(dps: Sequence["_DP"], workers: int) -> None:
    """``dp.run()`` for every search in ``dps``, ``workers`` at a time, in order (the most promising first); each
    one's best plan, counts, completeness and root bound are copied back. Every search keeps the incumbent it was
    given (they share none while running: the plan does not depend on timing or on the number of workers)."""
    global _JOBS
    if workers <= 1 or len(dps) <= 1:
        for dp in dps:
            dp.run()
        return
    _JOBS = list(dps)
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(dps)),
                                 mp_context=multiprocessing.get_context("fork")) as pool:
            for dp, (best, states, transitions, complete, root) in zip(dps, pool.map(_run, range(len(dps)))):
                dp.set_best(*best)
                dp.states, dp.transitions, dp.complete, dp.root_bound = states, transitions, complete, root
    except BrokenProcessPool as e:
        raise RuntimeError(f"a planner worker process died (out of memory?) while searching micro-batch sizes "
                           f"{[dp.b for dp in dps]} with {workers} workers; retry with workers=1") from e
    finally:
        _JOBS = []
