"""dapple.plan's plans of two chunks per device group: the cuts, the variants, schedule="auto" choosing one where it
simulates faster (and recording what it tried), a schedule of chunks asked for by name, the plan table."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

import dapple
from dapple import Plan
from dapple.core.schedule import CHUNKED_SCHEDULES
from dapple.planner import chunked, evaluate, simulate, tuning
from dapple.planner.chunked import LAYOUTS, balanced_cuts, chunked_trials, variant
from dapple.planner.simulator.events import Deadlock

from .helpers import cluster, linear_profile

# eight equal layers, heavy parameters (replication costs AllReduce), cheap transfers: a pipeline of four devices,
# whose bubble at M = 8 two chunks per device shrink
PROF = linear_profile([1.0] * 8, params=2e9, boundary=1e3, saved=1e5)
C = cluster(1, 4, intra=1e10)


def _brute(cost, pieces, send):
    n, best = len(cost[0]), None
    for cuts in itertools.combinations(range(1, n), len(pieces) - 1):
        b = [0, *cuts, n]
        worst = max(sum(cost[g][b[k]:b[k + 1]]) + (send(k, b[k + 1]) if k < len(pieces) - 1 else 0)
                    for k, g in enumerate(pieces))
        best = worst if best is None else min(best, worst)
    return best


def test_balanced_cuts_minimise_the_slowest_chunk():
    rng = random.Random(3)
    for _ in range(60):
        n, P = rng.randint(4, 9), rng.randint(2, 3)
        pieces = [rng.randrange(P) for _ in range(rng.randint(2, min(n, 5)))]
        cost = [[rng.uniform(0.1, 3) for _ in range(n)] for _ in range(P)]
        table = {(k, j): rng.choice([0.0, 0.5, 4.0]) for k in range(len(pieces)) for j in range(n + 1)}

        def send(k, j):
            return table[(k, j)]

        cuts = balanced_cuts(cost, pieces, send)
        assert [a for a, _ in cuts[1:]] == [b for _, b in cuts[:-1]] and cuts[0][0] == 0 and cuts[-1][1] == n
        assert all(b > a for a, b in cuts)
        worst = max(sum(cost[g][a:b]) + (send(k, b) if k < len(pieces) - 1 else 0)
                    for k, ((a, b), g) in enumerate(zip(cuts, pieces)))
        assert worst == pytest.approx(_brute(cost, pieces, send))


def test_the_cuts_avoid_a_costly_boundary():
    """A chunk cut where a large tensor crosses waits for it: the variant cuts elsewhere."""
    heavy = linear_profile([1.0] * 8, boundary=[1e3, 1e3, 1e3, 1e8, 1e3, 1e3, 1e3, 1e3])
    one = Plan(64, 8, [dapple.planner.Stage((0, 4), [0]), dapple.planner.Stage((4, 8), [1])])
    q = variant(heavy, cluster(2, 1, inter=1e9), one, [[0], [1]], "interleaved-1f1b")
    assert [s.layers for s in q.stages] != [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(s.layers[1] != 4 for s in q.stages)  # not after layer 3
    assert [s.devices for s in q.stages] == [[0], [1], [0], [1]]


def test_auto_takes_two_chunks_where_they_simulate_faster():
    base = dapple.plan(PROF, C, 32, micro_batch_size=4, workers=1)
    assert base.chunks.chunks == 1 and "schedule_choice" not in base.meta  # the default: one stage per group
    p = dapple.plan(PROF, C, 32, micro_batch_size=4, schedule="auto", workers=1)
    assert p.schedule in CHUNKED_SCHEDULES and p.chunks.chunks == 2
    choice = p.meta["schedule_choice"]
    assert choice["chosen"] == p.schedule and choice["chosen_layout"] in LAYOUTS
    tried = {(t["layout"], t["schedule"]): t for t in choice["chunked"]}
    assert {s for _, s in tried} == set(CHUNKED_SCHEDULES)
    mine = tried[(choice["chosen_layout"], p.schedule)]["simulated_ms"]
    assert mine < min(choice["simulated_ms"].values())  # faster than the one-stage plan under dapple and zb-h1
    assert p.estimate.latency_ms == pytest.approx(simulate(p, PROF, C).latency_ms)
    assert p.meta["simulated_ms"] == pytest.approx(mine, abs=1e-3)
    assert "latency_lower_bound_ms" not in p.meta
    assert evaluate(PROF, C, p).latency_ms == pytest.approx(p.estimate.latency_ms)
    again = Plan.from_dict(p.to_dict())
    assert again.to_dict() == p.to_dict() and again.placement == p.placement
    text = str(p)
    assert "these chunks were not searched: no lower bound or optimality is claimed" in text
    assert "simulated, not searched): this plan simulated fastest" in text


def test_auto_keeps_one_stage_per_group_where_chunks_are_slower():
    """Two layers on two devices cannot make four chunks on them; on one device group the AllReduce dominates."""
    prof = linear_profile([1.0] * 3, params=1e6, boundary=1e3)
    p = dapple.plan(prof, cluster(1, 2, intra=1e11), 16, schedule="auto", workers=1)
    assert p.chunks.chunks == 1
    tried = p.meta["schedule_choice"]["chunked"]
    assert tried and all("refused" in t or "simulated_ms" in t for t in tried)
    assert "two chunks per device group" in str(p)


def test_auto_without_chunks_when_tuned_off(monkeypatch):
    monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(chunked_variants=False))
    p = dapple.plan(PROF, C, 32, micro_batch_size=4, schedule="auto", workers=1)
    assert p.chunks.chunks == 1 and "chunked" not in p.meta["schedule_choice"]


@pytest.mark.parametrize("schedule, placement", [("interleaved-1f1b", "loop"), ("zb-v", "V")])
def test_a_schedule_of_chunks_by_name(schedule, placement):
    p = dapple.plan(PROF, C, 32, micro_batch_size=4, schedule=schedule, workers=1)
    assert p.schedule == schedule and p.chunks.chunks == 2 and p.placement == placement
    assert all(t["schedule"] == schedule for t in p.meta["schedule_choice"]["chunked"])


def test_chunks_need_the_refined_model():
    with pytest.raises(ValueError, match="model='refined'"):
        dapple.plan(PROF, C, 32, schedule="zb-v", model="paper", overlap=False, workers=1)


def test_trials_say_why_a_layout_was_not_simulated():
    one = Plan(32, 8, [dapple.planner.Stage((0, 8), [0, 1, 2, 3])])
    records, plans = chunked_trials(PROF, C, one, CHUNKED_SCHEDULES, overlap=True, optimizer_factor=4.0)
    own = [r for r in records if r["layout"] == LAYOUTS[0]]
    assert all(r["refused"] == "one device group: no pipeline to interleave" for r in own)
    assert plans and all(records[k]["layout"] == LAYOUTS[1] for k in plans)
    tight = cluster(1, 4, intra=1e10, memory=8.1e9)  # two layers' parameters x 4 = 16 GB per device
    records, plans = chunked_trials(PROF, tight, one, CHUNKED_SCHEDULES, overlap=True, optimizer_factor=4.0)
    assert not plans and all("refused" in r for r in records)


def test_chunks_never_cut_where_the_profile_forbids():
    base = linear_profile([1.0] * 12, params=2e9, boundary=1e3, saved=1e5)
    layers = [dataclasses.replace(layer, cuttable=i not in (0, 5)) for i, layer in enumerate(base.layers)]
    prof = dapple.Profile(base.model, base.device, base.batch_sizes, layers)
    p = dapple.plan(prof, C, 32, micro_batch_size=4, schedule="zb-v", workers=1)
    assert p.chunks.chunks == 2 and p.num_layers == 12
    assert not {s.layers[1] - 1 for s in p.stages} & set(prof.uncuttable)
    assert evaluate(prof, C, p).latency_ms == pytest.approx(p.estimate.latency_ms)


def test_a_variant_whose_order_deadlocks_is_refused(monkeypatch):
    def stuck(*args, **kwargs):
        raise Deadlock("schedule deadlocks: device 0 (stage 5) waits forever at F6@s5")

    monkeypatch.setattr(chunked, "simulate", stuck)
    one = Plan(32, 4, [dapple.planner.Stage((2 * i, 2 * i + 2), [i]) for i in range(4)])
    records, plans = chunked_trials(PROF, C, one, CHUNKED_SCHEDULES, overlap=True, optimizer_factor=4.0)
    assert not plans and all(r["refused"].startswith("schedule deadlocks") for r in records)


def test_moved_cuts_follow_the_simulator_within_the_budget():
    """The local search over chunk cuts takes a move only where the judge says faster, and stops at its budget."""
    q = variant(PROF, C, dapple.plan(PROF, C, 32, 4, verify=0), [[0, 1], [2, 3]], "interleaved-1f1b")
    start = [s.layers for s in q.stages]
    target = [(0, 1), (1, 3), (3, 6), (6, 8)]

    def judge(p):  # a made-up cost: the distance of the cuts from the target's (None: 'does not fit')
        cuts = [s.layers for s in p.stages]
        return None if cuts[0] == (0, 2) and cuts != start else 100.0 + sum(
            abs(a - b) for (a, _), (b, _) in zip(cuts, target))
    got, ms, moves = chunked.moved_cuts(q, judge(q), judge, budget=200)
    assert [s.layers for s in got.stages] == target and ms == 100.0 and moves == judge(q) - 100.0
    assert all(s.warmup is not None for s in got.stages) and got.schedule == "interleaved-1f1b"
    same, ms0, none = chunked.moved_cuts(q, judge(q), judge, budget=0)
    assert same is q and none == 0 and ms0 == judge(q)
    slower, _, _ = chunked.moved_cuts(q, judge(q), lambda p: 1e9, budget=200)  # nothing faster: nothing moves
    assert [s.layers for s in slower.stages] == start


def test_the_fastest_variant_has_its_cuts_moved_and_says_how_many():
    p = dapple.plan(PROF, C, 32, 4, schedule="auto", verify=0)
    trials = p.meta["schedule_choice"]["chunked"]
    moved = [t for t in trials if "moves" in t]
    assert len(moved) == 1 and moved[0]["moves"] >= 0
    assert moved[0]["simulated_ms"] == min(t["simulated_ms"] for t in trials if "simulated_ms" in t)
