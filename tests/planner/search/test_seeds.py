"""The DP's seed plans (seeds.py): replica patterns, and the local search over their cuts."""

from __future__ import annotations

import itertools
import random

from dapple import Cluster, Profile
from dapple.planner.model.cost import CostModel
from dapple.planner.search import seeds
from dapple.planner.search.dp import DPSearch, SearchConfig
from dapple.planner.search.seeds import balanced_cuts, even_seeds, refine_cuts, replica_patterns, scatter_layouts
from dapple.profiler import LayerProfile

from ..helpers import cluster, random_profile


def test_replica_patterns_use_every_device_and_include_split_servers():
    pats = list(replica_patterns(8, 4))
    assert all(sum(p) == 8 for p in pats)
    assert [8] in pats and [1] * 8 in pats  # one stage on all, one per device
    assert [4, 2, 2] in pats and [2, 2, 4] in pats and [2, 2, 2, 2] in pats  # servers halved, at the end or start
    assert list(replica_patterns(3, 1)) == [[3], [2, 1], [1, 1, 1]]  # one device per server: nothing to halve


def test_scatter_layouts_share_the_last_servers_evenly():
    pats = list(scatter_layouts(4, 8))
    for lays in pats:
        used = [d for lay in lays for d in lay]
        assert sorted(used) == [s for s in range(4) for _ in range(8)], lays  # every device once
        group = [lay for lay in lays if len(set(lay)) > 1]  # the stages over the last k servers
        k = len(set(group[0]))
        assert all(lay == (s,) * 8 for s, lay in enumerate(lays[:len(lays) - len(group)]))  # whole servers first
        assert all(set(lay) == set(range(4 - k, 4)) and len(lay) == k * lay.count(3) for lay in group), lays
    # the tail of the best 8x8 plans: 4, 8, 8, 8, 4 replicas over the last 4 servers
    tail = [(0, 1, 2, 3)] + [(0, 0, 1, 1, 2, 2, 3, 3)] * 3 + [(0, 1, 2, 3)]
    assert tail in pats and [(0,) * 8, (1,) * 8] + [(2, 2, 2, 2, 3, 3, 3, 3)] * 2 in pats
    assert len(pats) == 2 * 5 and list(scatter_layouts(16, 1)) == []  # k = 2, 4; one device per server: none


def test_scatter_seeds_give_a_deep_stack_a_better_incumbent(monkeypatch):
    """24 transformer-like layers on 4 x 8 with micro-batch 32: the best seed after refine_seeds shares servers
    between stages (Scatter First), 4% faster than the best on consecutive devices."""
    def incumbent():
        dp = DPSearch(_stack(24), Cluster.preset("A", servers=4), 256, 32, SearchConfig("refined"))
        dp.seed()
        dp.refine_seeds()
        return dp.best
    lat, (spans, _, _) = incumbent()
    assert any(len(set(lay)) > 1 and len(lay) % len(set(lay)) == 0 and len(lay) < 32 for *_, lay in spans), spans
    monkeypatch.setattr(seeds, "scatter_layouts", lambda servers, per_server: iter(()))
    consecutive, _ = incumbent()
    assert lat < consecutive * 0.97, (lat, consecutive)


def _stack(n: int) -> Profile:
    """A transformer-like stack: n layers of +-30% compute, 50 MB of parameters each (benchmarks/planning_time.py)."""
    rng = random.Random(0)
    layers = []
    for i in range(n):
        f = rng.uniform(0.7, 1.3)
        layers.append(LayerProfile(f"block{i}", [0.2 + f, 0.2 + 8 * f], [0.4 + 2 * f, 0.4 + 16 * f], [4e6, 32e6],
                                   [16e6, 128e6], int(50e6)))
    return Profile("stack", "synthetic", [1, 8], layers)


def _dp(seed: int, layers: int, servers: int, per_server: int, g: int = 64, b: int = 8) -> DPSearch:
    prof = random_profile(random.Random(seed), layers)
    return DPSearch(prof, cluster(servers, per_server), g, b, SearchConfig("refined"))


def _lat(dp: DPSearch):
    return lambda spans: (dp.costs.evaluate_spans(spans) or (None,))[0]


def test_refine_cuts_never_worsens_keeps_layouts_and_finds_a_better_split():
    improved = 0
    for seed in range(8):
        dp = _dp(seed, 10, 2, 2)
        for spans in even_seeds(dp.cm, dp.rho, dp.G, dp.dps):
            if len(spans) < 2:
                continue
            before = _lat(dp)(spans)
            lat, out = refine_cuts(_lat(dp), spans)
            assert [lay for *_, lay in out] == [lay for *_, lay in spans]
            assert out[0][0] == 0 and out[-1][1] == 10 and all(a < c for a, c, _ in out)
            assert all(out[i][1] == out[i + 1][0] for i in range(len(out) - 1))
            assert lat == _lat(dp)(out)  # what it returns is the latency of the spans it returns
            if before is not None:
                assert lat <= before
                improved += lat < before * (1 - 1e-9)
    assert improved >= 30, improved  # cuts balanced by F + B are often not the fastest


def test_refine_cuts_respects_its_budget():
    dp = _dp(1, 12, 2, 2)
    spans = next(s for s in even_seeds(dp.cm, dp.rho, dp.G, dp.dps) if len(s) == 4)
    calls = []

    def lat(sp):
        calls.append(sp)
        return _lat(dp)(sp)

    refine_cuts(lat, spans, budget=5)
    assert len(calls) == 1 + 5  # the seed itself, then at most the budget


def test_refined_seeds_become_the_incumbent():
    dp = _dp(2, 12, 2, 2)
    dp.seed()
    seeded = dp.best[0]
    dp.refine_seeds()
    assert dp.best[0] <= seeded and dp.best[1] is not None
    spans = dp.best[1][0]
    assert abs(_lat(dp)(spans) - dp.best[0]) <= 1e-9 * dp.best[0]


def test_balanced_cuts_give_the_least_slowest_stage():
    """With equal replica counts balanced_cuts' bisection finds a min-max split: its slowest stage's F + B equals the
    brute force's over every placement of the cuts (random profiles, 2 to 4 stages). (With unequal counts the greedy
    cover is a heuristic: 4, 1, 4 replicas can put an expensive layer on the one-replica stage.)"""
    rng = random.Random(5)
    for _ in range(30):
        n = rng.randint(3, 9)
        cm = CostModel(random_profile(rng, n), cluster(1, 8), 8)
        reps = [rng.choice([1, 2, 4])] * rng.randint(2, min(4, n))

        def slowest(cuts):
            bounds = [0, *cuts, n]
            return max(sum(cm.compute(bounds[i], bounds[i + 1], r)) for i, r in enumerate(reps))

        got = balanced_cuts(cm, reps)
        best = min(slowest(c) for c in itertools.combinations(range(1, n), len(reps) - 1))
        assert abs(slowest(got) - best) <= 1e-9 * best, (reps, got)


def test_seed_bound_is_below_every_seeds_latency_and_lazy_pricing_keeps_the_same_seeds():
    """Seeder.seed_bound <= the priced L of every seed (both models, overlapped or not, random profiles and clusters,
    micro-batches from 1 to 16 rows), and seed(), which prices seeds in order of the bound and stops past the kept
    ones, ends with the incumbent and kept seeds of pricing all of them in generation order."""
    rng = random.Random(11)
    for trial in range(24):
        prof = random_profile(rng, rng.randint(4, 12))
        c = cluster(rng.choice([1, 2, 4]), rng.choice([2, 4]))
        b = rng.choice([1, 2, 4, 8, 16])
        model, overlap = rng.choice(["refined", "paper"]), rng.random() < 0.5
        dp = DPSearch(prof, c, 64, b, SearchConfig(model, overlap))
        every = []
        for i, spans in enumerate(even_seeds(dp.cm, dp.rho, dp.G, dp.dps)):
            res = dp.costs.evaluate_spans(spans)
            if res is not None:
                assert dp.seeder.seed_bound(spans) <= res[0] * (1 + 1e-9), (trial, spans)
                every.append((res[0], i, spans, res[1]))
        dp.seed()
        first = min(every, key=lambda x: (x[0], x[1])) if every else None
        want = (first[0], (first[2], ("even",) * len(first[2]), first[3])) if first else (float("inf"), None)
        assert dp.best == want
        every.sort(key=lambda x: (x[0], x[1]))
        assert dp.seeder.kept == [(lat, spans) for lat, _, spans, _ in every[:3]]


def test_seed_prices_fewer_than_half_the_seeds_of_a_deep_uniform_stack():
    """A transformer-like stack (32 layers of +-30% compute) on 4 x 8 with micro-batch 32: most seeds' slowest stage
    or bubbles put them past the kept ones before they are priced."""
    dp = DPSearch(_stack(32), Cluster.preset("A", servers=4), 256, 32, SearchConfig("refined"))
    n = sum(dp.costs.evaluate_spans(spans) is not None for spans in even_seeds(dp.cm, dp.rho, dp.G, dp.dps))
    dp.seed()
    assert dp.best[1] is not None and dp.seeder.priced < n / 2, (dp.seeder.priced, n)
