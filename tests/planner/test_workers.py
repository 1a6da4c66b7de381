"""Micro-batch sizes searched in forked workers: the same results as in-process, clear errors, no hang."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest

import dapple
from dapple.planner import judge, planning, tuning
from dapple.planner import workers as pool
from dapple.planner.judge import Candidate
from dapple.planner.planning import in_workers
from dapple.planner.search.dp import INF, DPSearch, SearchConfig
from dapple.planner.search.records import Best, Progress

from .helpers import cluster, random_profile

forks = pytest.mark.skipif(not pool.can_fork(), reason="workers are forked: Linux only")


def tuned(monkeypatch, **changes) -> None:
    monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(**changes))


def searches(prof, c, g, sizes, workers=1):
    dps = [DPSearch(prof, c, g, b, SearchConfig("refined", True, partial_kinds=1), INF) for b in sizes]
    in_workers(dps, workers, DPSearch.seed)
    return dps


@forks
def test_workers_copy_back_what_the_seeds_and_the_search_found():
    """Each size's seeds, then its best plan, counts, completeness and root bound, as the same steps in-process."""
    prof, c = random_profile(random.Random(3), 10), cluster(6, 2, inter=3e8)
    here, there = searches(prof, c, 48, [2, 4, 8]), searches(prof, c, 48, [2, 4, 8], workers=2)
    seeded = [(dp.best, dp.bar, dp.seeder.kept, dp.seeder.priced) for dp in here]
    assert [(dp.best, dp.bar, dp.seeder.kept, dp.seeder.priced) for dp in there] == seeded
    assert all(dp.seeder.priced > 0 and dp.best[1] is not None for dp in here)
    in_workers(here, 1, DPSearch.run)
    in_workers(there, 2, DPSearch.run)
    got = [(dp.best, dp.bar, dp.states, dp.transitions, dp.complete, dp.root_bound) for dp in there]
    assert got == [(dp.best, dp.bar, dp.states, dp.transitions, dp.complete, dp.root_bound) for dp in here]
    assert sum(dp.states for dp in here) > 3  # the searches did work (not only their roots)
    assert [dp.best for dp in here] != [s[0] for s in seeded]  # and found better plans than the seeds


@forks
@pytest.mark.parametrize("seed", [5, 6])
def test_plan_is_the_same_for_any_number_of_workers(seed):
    prof, c = random_profile(random.Random(seed), 12), cluster(6, 2, inter=3e8)
    plans = [dapple.plan(prof, c, 48, workers=w, overlap=True) for w in (1, 2, 3)]
    assert [p.meta["workers"] for p in plans] == [1, 2, 3]
    for p in plans[1:]:
        assert [(s.layers, s.devices, s.warmup) for s in p.stages] == \
            [(s.layers, s.devices, s.warmup) for s in plans[0].stages]
        assert (p.micro_batch_size, p.warmup_policy) == (plans[0].micro_batch_size, plans[0].warmup_policy)
        assert p.estimate.latency_ms == plans[0].estimate.latency_ms
        assert p.meta["dp_states"] == plans[0].meta["dp_states"]
        assert p.meta["simulated_ms"] == plans[0].meta["simulated_ms"]
    assert len(plans[0].meta["micro_batch_sizes_tried"]) > 2


@pytest.mark.parametrize("workers, message", [(0, r"workers: expected a positive int or 'auto', got 0"),
                                              ("all", r"workers: expected a positive int or 'auto', got 'all'"),
                                              (2.0, r"workers: expected a positive int or 'auto', got 2.0")])
def test_bad_workers_are_refused(workers, message):
    prof, c = random_profile(random.Random(0), 6), cluster(6, 2)
    with pytest.raises(ValueError, match=message):
        dapple.plan(prof, c, 24, workers=workers)


def test_workers_need_fork(monkeypatch):
    monkeypatch.setattr(pool, "can_fork", lambda: False)
    monkeypatch.setattr(pool.sys, "platform", "darwin")
    with pytest.raises(ValueError, match=r"workers=2: the searches run in forked processes, which darwin"):
        pool.resolve_workers(2, 4, True)
    assert pool.resolve_workers("auto", 4, True) == 1  # auto falls back to in-process


def test_auto_forks_only_for_the_compact_search(monkeypatch):
    monkeypatch.setattr(pool, "can_fork", lambda: True)
    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert pool.resolve_workers("auto", 10, True) == 4  # one per core
    assert pool.resolve_workers("auto", 3, True) == 3  # one per search
    assert pool.resolve_workers("auto", 10, False) == 1  # the full search: a fork costs more than a size
    assert pool.resolve_workers(8, 3, False) == 3
    monkeypatch.setattr(pool, "available_memory", lambda: 2.5 * tuning.TUNING.worker_memory)
    assert pool.resolve_workers("auto", 10, True) == 2  # no more than fit in memory
    monkeypatch.setattr(pool, "available_memory", lambda: 0.5 * tuning.TUNING.worker_memory)
    assert pool.resolve_workers("auto", 10, True) == 1
    assert pool.resolve_workers(3, 10, True) == 3  # asked for: as many


@forks
def test_auto_forks_a_full_search_only_where_it_takes_long(monkeypatch):
    """workers="auto" keeps a full search (few servers) in-process, unless its seeds took SearchTuning.fork_worth
    seconds: then its searches and simulations run in workers, with the same plan (here: fork_worth 0)."""
    monkeypatch.setattr(pool.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    prof, c = random_profile(random.Random(5), 10), cluster(2, 2, inter=3e8)
    alone = dapple.plan(prof, c, 48, workers=1)
    tuned(monkeypatch, fork_worth=float("inf"))
    assert dapple.plan(prof, c, 48).meta["workers"] == 1  # auto: a full search, quick
    tuned(monkeypatch, fork_worth=0.0)
    forked = dapple.plan(prof, c, 48)
    assert forked.meta["search"] == "full" and forked.meta["workers"] == 2
    assert [(s.layers, s.devices, s.warmup) for s in forked.stages] == \
        [(s.layers, s.devices, s.warmup) for s in alone.stages]
    assert (forked.micro_batch_size, forked.meta["dp_states"], forked.meta["simulated_ms"]) == \
        (alone.micro_batch_size, alone.meta["dp_states"], alone.meta["simulated_ms"])


@forks
def test_auto_forks_the_simulations_where_they_take_long(monkeypatch):
    """plan()'s final choice simulates its first candidate in-process; the rest go to workers ("auto") only if
    they would take SearchTuning.fork_worth seconds at that pace: the same choice and times either way."""

    prof = random_profile(random.Random(5), 6)
    c = cluster(2, 2, intra=5e10, inter=1e9)
    split = ((0, 3, (0, 0)), (3, 6, (1, 1))), ("even", "even")
    cands = [Candidate(100.0, 8, *split), Candidate(101.0, 4, *split), Candidate(102.0, 2, *split)]
    args = (prof, c, 64, cands)
    kw = dict(model="refined", overlap=False, schedule="dapple", warmup_policy=None, optimizer_factor=4.0, verify=6,
              deadline=None, workers=1)
    alone = judge.choose(*args, **kw)
    assert alone[2] == 6 and alone[4] == 1
    tuned(monkeypatch, fork_worth=float("inf"))
    assert judge.choose(*args, **kw, spare=2) == alone  # quick: in-process
    tuned(monkeypatch, fork_worth=0.0)
    # the same choice, but it may simulate more (it skips a round at a time)
    forked = judge.choose(*args, **kw, spare=2)
    assert forked[:3] + forked[4:] == alone[:3] + (2,) and forked[3] >= alone[3]


@forks
def test_sizes_refined_side_by_side_keep_what_one_at_a_time_would():
    """refine_promising with workers refines every size within refine_within of the best seed at once and keeps
    what the rule one at a time would: micro-batch 4 (104, within 5% of 100 but not of 96) keeps its seed."""
    class Size:
        def __init__(self, b, seed, refined):
            self.b, self.best, self.refined, self._seeds = b, Best(seed, None), refined, ["seed"]

        def refine_seeds(self):
            self.best, self._seeds = Best(self.refined, "refined"), []
            return Progress(self.best, self._seeds)

        def adopt(self, outcome):
            self.best, self._seeds = outcome.best, outcome.seeds

    def refined(workers, spec):
        sizes = [Size(*x) for x in spec]
        planning.refine_promising(sizes, workers)
        return [(s.b, s.best, s._seeds) for s in sizes]
    spec = [(4, 104.0, 103.0), (8, 100.0, 96.0), (16, 100.5, 100.0)]
    assert refined(2, spec) == refined(1, spec) == [(4, (104.0, None), ["seed"]), (8, (96.0, "refined"), []),
                                                    (16, (100.0, "refined"), [])]
    spec = [(4, 104.0, 103.0), (8, 100.0, 99.5), (32, 110.0, 90.0)]
    assert refined(2, spec) == refined(1, spec) == [(4, (103.0, "refined"), []), (8, (99.5, "refined"), []),
                                                    (32, (110.0, None), ["seed"])]


def test_available_memory_is_read_from_the_system():
    assert pool.available_memory() > 0


def test_a_daemonic_pool_worker_plans_in_process(monkeypatch):
    monkeypatch.setattr(pool, "can_fork", lambda: True)
    monkeypatch.setattr(pool.multiprocessing.current_process(), "daemon", True)
    assert pool.resolve_workers("auto", 4, True) == 1
    with pytest.raises(ValueError, match=r"workers=2: this process \(MainProcess\) is a daemonic pool worker"):
        pool.resolve_workers(2, 4, True)


def _die(task, item):
    os._exit(3)


@forks
@pytest.mark.timeout(60)
def test_a_dead_worker_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(pool, "_apply", _die)  # the forked workers inherit it
    prof, c = random_profile(random.Random(1), 8), cluster(6, 2)
    dps = searches(prof, c, 24, [2, 4])
    with pytest.raises(RuntimeError, match=r"a planner worker process died \(out of memory\?\) in run\(\) of "
                                           r"micro-batch sizes \[2, 4\] with 2 workers"):
        in_workers(dps, 2, DPSearch.run)
    _no_worker_left()



def _hang(task, item):
    time.sleep(600)


def _no_worker_left() -> None:
    """The workers' processes are gone (reaped shortly after)."""
    for _ in range(50):
        if not multiprocessing.active_children():
            break
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


def _spin(i):
    end = time.process_time() + 1.5  # CPU seconds: busy the whole time
    while time.process_time() < end:
        pass
    return i


def _raise_on_term(signum, frame):
    raise RuntimeError("SIGTERM")  # as a launcher's handler does (torch's elastic agent raises SignalException)


@forks
@pytest.mark.timeout(60)
@pytest.mark.parametrize("parent_handles_sigterm", [False, True])
def test_a_stuck_worker_is_an_error_not_a_hang(monkeypatch, parent_handles_sigterm):
    """Workers that use no CPU with work pending (a fork of a multi-threaded process can deadlock) stop the step
    with an error naming it after SearchTuning.worker_stuck seconds, and are ended, not left behind -- also when the
    parent installed a SIGTERM handler that raises (the workers inherit it; one waiting on a queue lock would
    catch the exception and wait again, and the interpreter's exit would join it forever)."""
    old = signal.signal(signal.SIGTERM, _raise_on_term if parent_handles_sigterm else signal.getsignal(signal.SIGTERM))
    try:
        _stuck_workers_are_ended(monkeypatch)
    finally:
        signal.signal(signal.SIGTERM, old)


def _stuck_workers_are_ended(monkeypatch) -> None:
    monkeypatch.setattr(pool, "_apply", _hang)
    tuned(monkeypatch, worker_stuck=1.0, poll=0.2)
    prof, c = random_profile(random.Random(1), 8), cluster(6, 2)
    dps = searches(prof, c, 24, [2, 4])
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"planner workers used no CPU for 1 s in run\(\) of micro-batch sizes "
                                           r"\[2, 4\] with 2 workers, 2 of 2 items left \(stuck: .*\); retry with "
                                           r"workers=1"):
        in_workers(dps, 2, DPSearch.run)
    assert time.perf_counter() - t < 20
    _no_worker_left()


@forks
@pytest.mark.timeout(60)
def test_a_busy_worker_is_not_stuck_however_long_it_takes(monkeypatch):
    tuned(monkeypatch, worker_stuck=1.0, poll=0.2)
    assert pool.forked_map(_spin, [0, 1, 2], 2, "spinning") == [0, 1, 2]  # 1.5 s of CPU each
