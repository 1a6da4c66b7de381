"""Micro-batch sizes searched in forked workers: the same results as in-process, clear errors, no hang."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest

import dapple
from dapple.planner.search import forking
from dapple.planner.search.choice import Candidate
from dapple.planner.search.dp import INF, DPSearch, SearchConfig
from dapple.planner.search.records import Best, RefineOutcome

from ..helpers import cluster, random_profile

forks = pytest.mark.skipif(not forking.can_fork(), reason="workers are forked: Linux only")


def searches(prof, c, g, sizes, workers=1):
    dps = [DPSearch(prof, c, g, b, SearchConfig("refined", True, partial_kinds=1), INF) for b in sizes]
    forking.in_workers(dps, workers, "seed")
    return dps


@forks
def test_workers_copy_back_what_the_seeds_and_the_search_found():
    """Each size's seeds, then its best plan, counts, completeness and root bound, as the same steps in-process."""
    prof, c = random_profile(random.Random(3), 10), cluster(6, 2, inter=3e8)
    here, there = searches(prof, c, 48, [2, 4, 8]), searches(prof, c, 48, [2, 4, 8], workers=2)
    seeded = [(dp.best, dp.cut, dp.seeder.kept, dp.seeder.priced) for dp in here]
    assert [(dp.best, dp.cut, dp.seeder.kept, dp.seeder.priced) for dp in there] == seeded
    assert all(dp.seeder.priced > 0 and dp.best[1] is not None for dp in here)
    forking.in_workers(here, 1, "run")
    forking.in_workers(there, 2, "run")
    got = [(dp.best, dp.cut, dp.states, dp.transitions, dp.complete, dp.root_bound) for dp in there]
    assert got == [(dp.best, dp.cut, dp.states, dp.transitions, dp.complete, dp.root_bound) for dp in here]
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
    monkeypatch.setattr(forking, "can_fork", lambda: False)
    monkeypatch.setattr(forking.sys, "platform", "darwin")
    with pytest.raises(ValueError, match=r"workers=2: the searches run in forked processes, which darwin"):
        forking.resolve_workers(2, 4, True)
    assert forking.resolve_workers("auto", 4, True) == 1  # auto falls back to in-process


def test_auto_forks_only_for_the_compact_search(monkeypatch):
    monkeypatch.setattr(forking, "can_fork", lambda: True)
    monkeypatch.setattr(forking.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert forking.resolve_workers("auto", 10, True) == 4  # one per core
    assert forking.resolve_workers("auto", 3, True) == 3  # one per search
    assert forking.resolve_workers("auto", 10, False) == 1  # the full search: a fork costs more than a size
    assert forking.resolve_workers(8, 3, False) == 3
    monkeypatch.setattr(forking, "available_memory", lambda: 2.5 * forking.WORKER_MEMORY)
    assert forking.resolve_workers("auto", 10, True) == 2  # no more than fit in memory
    monkeypatch.setattr(forking, "available_memory", lambda: 0.5 * forking.WORKER_MEMORY)
    assert forking.resolve_workers("auto", 10, True) == 1
    assert forking.resolve_workers(3, 10, True) == 3  # asked for: as many


@forks
def test_auto_forks_a_full_search_only_where_it_takes_long(monkeypatch):
    """workers="auto" keeps a full search (few servers) in-process, unless its seeds took forking.FORK_WORTH
    seconds: then its searches and simulations run in workers, with the same plan (here: FORK_WORTH 0)."""
    monkeypatch.setattr(forking.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    prof, c = random_profile(random.Random(5), 10), cluster(2, 2, inter=3e8)
    alone = dapple.plan(prof, c, 48, workers=1)
    monkeypatch.setattr(forking, "FORK_WORTH", float("inf"))
    assert dapple.plan(prof, c, 48).meta["workers"] == 1  # auto: a full search, quick
    monkeypatch.setattr(forking, "FORK_WORTH", 0.0)
    forked = dapple.plan(prof, c, 48)
    assert forked.meta["search"] == "full" and forked.meta["workers"] == 2
    assert [(s.layers, s.devices, s.warmup) for s in forked.stages] == \
        [(s.layers, s.devices, s.warmup) for s in alone.stages]
    assert (forked.micro_batch_size, forked.meta["dp_states"], forked.meta["simulated_ms"]) == \
        (alone.micro_batch_size, alone.meta["dp_states"], alone.meta["simulated_ms"])


@forks
def test_auto_forks_the_simulations_where_they_take_long(monkeypatch):
    """plan()'s final choice simulates its first candidate in-process; the rest go to workers ("auto") only if
    they would take forking.FORK_WORTH seconds at that pace: the same choice and times either way."""
    from dapple.planner.search import choice

    prof = random_profile(random.Random(5), 6)
    c = cluster(2, 2, intra=5e10, inter=1e9)
    split = ((0, 3, (0, 0)), (3, 6, (1, 1))), ("even", "even")
    cands = [Candidate(100.0, 8, *split), Candidate(101.0, 4, *split), Candidate(102.0, 2, *split)]
    args = (prof, c, 64, cands)
    kw = dict(model="refined", overlap=False, schedule="dapple", warmup_policy=None, optimizer_factor=4.0, verify=6,
              deadline=None, workers=1)
    alone = choice.choose(*args, **kw)
    assert alone[2] == 6 and alone[4] == 1
    monkeypatch.setattr(forking, "FORK_WORTH", float("inf"))
    assert choice.choose(*args, **kw, spare=2) == alone  # quick: in-process
    monkeypatch.setattr(forking, "FORK_WORTH", 0.0)
    # the same choice, but it may simulate more (it skips a round at a time)
    forked = choice.choose(*args, **kw, spare=2)
    assert forked[:3] + forked[4:] == alone[:3] + (2,) and forked[3] >= alone[3]


@forks
def test_sizes_refined_side_by_side_keep_what_one_at_a_time_would():
    """refine_promising with workers refines every size within REFINE_WITHIN of the best seed at once and keeps
    what the rule one at a time would: micro-batch 4 (104, within 5% of 100 but not of 96) keeps its seed."""
    from dapple.planner import planning

    class Size:
        def __init__(self, b, seed, refined):
            self.b, self.best, self.refined, self._seeds = b, Best(seed, None), refined, ["seed"]

        def refine_seeds(self):
            self.best, self._seeds = Best(self.refined, "refined"), []
            return RefineOutcome(self.best, self._seeds)

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
    assert forking.available_memory() > 0


def test_a_daemonic_pool_worker_plans_in_process(monkeypatch):
    monkeypatch.setattr(forking, "can_fork", lambda: True)
    monkeypatch.setattr(forking.multiprocessing.current_process(), "daemon", True)
    assert forking.resolve_workers("auto", 4, True) == 1
    with pytest.raises(ValueError, match=r"workers=2: this process \(MainProcess\) is a daemonic pool worker"):
        forking.resolve_workers(2, 4, True)


def _die(i):
    os._exit(3)


@forks
@pytest.mark.timeout(60)
def test_a_dead_worker_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(forking, "_apply", _die)  # the forked workers inherit it
    prof, c = random_profile(random.Random(1), 8), cluster(6, 2)
    dps = searches(prof, c, 24, [2, 4])
    with pytest.raises(RuntimeError, match=r"a planner worker process died \(out of memory\?\) in run\(\) of "
                                           r"micro-batch sizes \[2, 4\] with 2 workers"):
        forking.in_workers(dps, 2, "run")
    assert forking._RUNNING == ()



def _hang(i):
    time.sleep(600)


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
    with an error naming it after forking.WORKER_STUCK seconds, and are ended, not left behind -- also when the
    parent installed a SIGTERM handler that raises (the workers inherit it; one waiting on a queue lock would
    catch the exception and wait again, and the interpreter's exit would join it forever)."""
    old = signal.signal(signal.SIGTERM, _raise_on_term if parent_handles_sigterm else signal.getsignal(signal.SIGTERM))
    try:
        _stuck_workers_are_ended(monkeypatch)
    finally:
        signal.signal(signal.SIGTERM, old)


def _stuck_workers_are_ended(monkeypatch) -> None:
    monkeypatch.setattr(forking, "_apply", _hang)
    monkeypatch.setattr(forking, "WORKER_STUCK", 1.0)
    monkeypatch.setattr(forking, "POLL", 0.2)
    prof, c = random_profile(random.Random(1), 8), cluster(6, 2)
    dps = searches(prof, c, 24, [2, 4])
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"planner workers used no CPU for 1 s in run\(\) of micro-batch sizes "
                                           r"\[2, 4\] with 2 workers, 2 of 2 items left \(stuck: .*\); retry with "
                                           r"workers=1"):
        forking.in_workers(dps, 2, "run")
    assert time.perf_counter() - t < 20
    assert forking._RUNNING == ()
    for _ in range(50):  # the pool's processes are gone (reaped shortly after)
        if not multiprocessing.active_children():
            break
        time.sleep(0.1)
    assert multiprocessing.active_children() == []


@forks
@pytest.mark.timeout(60)
def test_a_busy_worker_is_not_stuck_however_long_it_takes(monkeypatch):
    monkeypatch.setattr(forking, "WORKER_STUCK", 1.0)
    monkeypatch.setattr(forking, "POLL", 0.2)
    assert forking.forked_map(_spin, [0, 1, 2], 2, "spinning") == [0, 1, 2]  # 1.5 s of CPU each
