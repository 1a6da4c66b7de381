"""The DP's lower bounds (bounds.py, bound_tables.py) never exceed the brute-force optimum; the AllReduce floor is a
floor."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dapple.core.schedule import warmup_counts
from dapple.planner import tuning
from dapple.planner.baselines.exhaustive import every_plan, exhaustive_search
from dapple.planner.model.cost import CostModel
from dapple.planner.model.evaluate import pipeline_costs
from dapple.planner.model.pivot import paper_latency
from dapple.planner.search import bounds
from dapple.planner.search.bound_tables import (
    allreduce_floor,
    efficient_replicas,
    rest_bound,
)
from dapple.planner.search.bounds import prefix_u_table
from dapple.planner.search.dp import DPSearch, SearchConfig
from dapple.planner.search.exact import priced_plans
from dapple.planner.search.records import Prefix

from ..helpers import cluster, hidden_allreduce_instances, pivot_hides_allreduce, random_profile, small_instances


@pytest.mark.parametrize("overlap", [False, True])
def test_root_bounds_are_below_every_plan(overlap):
    """Q (backwards before each stage) and Qar (each stage's least AllReduce; overlapped: what of it can follow
    the last backward) bound the refined model's L of every plan: here, the optimum over all splits x device
    assignments."""
    checked = 0
    cases = small_instances(11, 30, max_layers=5, inter=(3e9, 1e8), memory=(16e9, 3e9), batches=(16, 32),
                            micro=(2, 4, 8))
    for prof, c, g, b in cases:
        best = exhaustive_search(prof, c, g, b, model="refined", overlap=overlap)[0]
        if best == float("inf"):
            continue
        dp = DPSearch(prof, c, g, b, SearchConfig("refined", overlap), float("inf"))
        dp.bound_tables()
        assert dp.pruner.Q[0][dp.G] <= best * (1 + 1e-9)
        assert dp.pruner.Qar[0][dp.G] <= best * (1 + 1e-9)
        checked += 1
    assert checked >= 20


def _hides_allreduce(cm: CostModel, spans: tuple, M: int) -> bool:
    """Whether formula 2 prices the plan below M (F + B) + AllReduce of a stage after its pivot (Te subtracts the
    backwards from that stage's AllReduce)."""
    pc, _ = pipeline_costs(cm, spans, M, "A", check=False)
    lat = paper_latency(pc.F, pc.B, pc.AR, M)
    return any(M * (pc.F[s] + pc.B[s]) + pc.AR[s] > lat.total for s in range(lat.pivot + 1, len(pc.F)))


def test_formula_2_bounds_hold_where_the_pivot_hides_an_allreduce():
    """Under formula 2 a plan's L can be below M (F + B) + AllReduce of a stage after its pivot, so the rest bound
    below a bar keeps the stages whose M (F + B) alone is below it: with the bar just above the optimum and 5% above
    it, Q of every plan's rest (after each of its stages) and the root bound stay at most the plan's L, on
    pivot_hides_allreduce and instances of its kind (whose optimum mostly hides an AllReduce so)."""
    hidden, config = 0, SearchConfig("paper")
    for prof, c, g, b in [pivot_hides_allreduce(), *hidden_allreduce_instances(2, 40)]:
        M, cm = g // b, CostModel(prof, c, b)
        plans = priced_plans(cm, M, config)  # lowest first
        best = plans[0][0]
        hidden += _hides_allreduce(cm, plans[0][1], M)
        for bar in (best * (1 + 1e-9), best * 1.05):
            dp = DPSearch(prof, c, g, b, config, bar)
            dp.bound_tables()
            assert dp.root_bound <= best, (c.name, bar, dp.root_bound, best)
            for lat, spans, _ in plans:
                if lat >= bar:
                    break
                for k in range(len(spans)):  # stages [0, k) planned, [k, S) the rest on the devices they leave
                    j, R = spans[k][0], sum(len(lay) for _, _, lay in spans[k:])
                    assert dp.pruner.Q[j][R] <= lat * (1 + 1e-9), (c.name, bar, spans, k)
    assert hidden >= 8, hidden


def test_the_allreduce_bound_sees_what_replication_costs():
    """One layer of 1 GB on 2 devices: halving the slice looks cheaper to Q, but its AllReduce takes 1 s, which
    Qar charges; both stay below the optimum."""
    prof = random_profile(random.Random(0), 1)
    prof.layers[0].param_bytes = int(1e9)
    c = cluster(1, 2, intra=1e9)
    dp = DPSearch(prof, c, 64, 4, SearchConfig("refined", optimizer_factor=1.0), float("inf"))
    dp.bound_tables()
    best = exhaustive_search(prof, c, 64, 4, model="refined", optimizer_factor=1.0)[0]
    assert dp.pruner.Q[0][dp.G] < dp.pruner.Qar[0][dp.G] <= best


@pytest.mark.parametrize("replicas", [2, 3, 4, 6])
def test_allreduce_floor_is_at_most_any_placement(replicas):
    c = cluster(3, 2, intra=1e10, inter=1e9, intra_lat=5e-6, inter_lat=3e-5)
    cm = CostModel(random_profile(random.Random(1), 3), c, 6)
    params = np.array([0.0, 1e6, 3e8])
    floor = allreduce_floor(cm, replicas, params)
    assert floor[0] == 0.0
    layouts = [tuple(d // 2 for d in range(replicas)), tuple(range(3))[:replicas] if replicas <= 3 else None]
    for lay in filter(None, layouts):
        for p, f in zip(params, floor):
            assert f <= cm.ring_allreduce_ms(p, lay) * (1 + 1e-12)


def test_rest_bound_is_monotone():
    prof = random_profile(random.Random(3), 6)
    cm = CostModel(prof, cluster(2, 2), 8)
    for allreduce in (False, True):
        q = rest_bound(cm, 4, 4, fill=True, allreduce=allreduce)
        assert (np.diff(q[:, 1:], axis=0) <= 1e-9).all()  # fewer layers left: no larger
        assert (np.diff(q, axis=1) <= 1e-9).all()  # more devices: no larger



def _rest_bound_by_loops(cm, M, G, fill, allreduce, bar, overlap, chain_allreduce=True):
    """rest_bound's docstring as plain loops: Q[j][R] = min over the first stage [j, c) on r <= R replicas
    (r among efficient_replicas) of max(M T + AR, F + Q[c][R - r]) (allreduce) or max(M T, T + Q[c][R - r]) (or
    max(M T, Q[c][R - r]) without ``fill``), over stages whose M T (+ AR with ``chain_allreduce``) is below ``bar``."""
    N, inf = cm.num_layers, float("inf")
    Q = [[inf] * (G + 1) for _ in range(N)] + [[0.0] * (G + 1)]
    for j in range(N - 1, -1, -1):
        for c in range(j + 1, N + 1):
            for r in efficient_replicas(cm.micro, G):
                f, b = cm.compute(j, c, r)
                if cm.params(j, c) * cm.optimizer_factor + cm.saved_bytes(j, c, r) > cm.cluster.device_memory:
                    continue
                ar = float(allreduce_floor(cm, r, np.array([cm.params(j, c)]))[0])
                if overlap:
                    ar = max(ar - b, 0.0)
                if M * (f + b) + (ar if chain_allreduce else 0.0) >= bar:
                    continue
                for R in range(r, G + 1):
                    if allreduce:
                        v = max(M * (f + b) + ar, f + Q[c][R - r])  # the rest follows this stage's F
                    else:
                        v = max(M * (f + b), (f + b if fill else 0.0) + Q[c][R - r])
                    Q[j][R] = min(Q[j][R], v)
    return Q


@pytest.mark.parametrize("allreduce", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("row_wise", [False, True])
def test_rest_bound_equals_its_definition(allreduce, overlap, row_wise, monkeypatch):
    """The table, computed over every replica count at once (or one at a time, as on many devices), equals the
    DP of its docstring as loops."""
    monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(row_wise_devices=0 if row_wise else 10 ** 9))
    rng = random.Random(7)
    for k in range(6):
        prof = random_profile(rng, rng.randint(2, 6))
        c = cluster(rng.choice([1, 2]), rng.choice([2, 3]), memory=rng.choice([1e12, 8e9]))
        cm = CostModel(prof, c, rng.choice([2, 4, 8]))
        for bar in (float("inf"), 200.0):
            q = rest_bound(cm, 4, c.num_devices, fill=True, allreduce=allreduce, bar=bar, overlap=overlap)
            ref = _rest_bound_by_loops(cm, 4, c.num_devices, True, allreduce, bar, overlap)
            assert np.allclose(q, np.array(ref), rtol=1e-12, atol=0), (k, bar)
            if not allreduce:  # formula 2's: no fill, a stage's own chain without its AllReduce
                q = rest_bound(cm, 4, c.num_devices, fill=False, bar=bar, overlap=overlap, chain_allreduce=False)
                ref = _rest_bound_by_loops(cm, 4, c.num_devices, False, False, bar, overlap, chain_allreduce=False)
                assert np.allclose(q, np.array(ref), rtol=1e-12, atol=0), (k, bar)

def test_rest_bound_row_wise_gives_the_same_table(monkeypatch):
    """Both ways of computing the table (all replica counts at once; one at a time from row_wise_devices devices
    on) give the same numbers, bit for bit, on a case with many replica counts and a bar."""
    rng = random.Random(11)
    prof = random_profile(rng, 12)
    cm = CostModel(prof, cluster(4, 4), 64)
    for allreduce in (False, True):
        for bar in (float("inf"), 2000.0):  # 2000: no plan on 4 devices or fewer (Q[0][5] ~ 1900 ms)
            tables = []
            for devices in (10 ** 9, 0):
                monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(row_wise_devices=devices))
                tables.append(rest_bound(cm, 8, 16, fill=True, allreduce=allreduce, bar=bar))
            assert np.isfinite(tables[0][0, 16])
            assert np.array_equal(tables[0], tables[1]), (allreduce, bar)


def _checked(dp: DPSearch) -> DPSearch:
    """The DP with its rest-chain rejection turned into an assertion: every candidate that reaches the check is
    evaluated in full, and its latency must not be below the bound that would have rejected it (its pruner's
    rest_chain and its stage costs' latency wrapped)."""
    rest_chain, latency = dp.pruner.rest_chain, dp.costs.latency

    def checked_rest_chain(*args):
        dp.pending = rest_chain(*args)
        dp.checks = getattr(dp, "checks", 0) + 1
        return -float("inf")

    def checked_latency(F, B, AR, E, C, D, *, link_period, limit=float("inf"), window=None, drain=None, queue=None,
                        feed=None):
        lat, pol = latency(F, B, AR, E, C, D, link_period=link_period, window=window, drain=drain, queue=queue,
                           feed=feed)
        bound, dp.pending = getattr(dp, "pending", None), None
        if bound is not None:
            assert bound <= lat * (1 + 1e-9), (bound, lat)
        return lat, pol
    dp.pruner.rest_chain, dp.costs.latency = checked_rest_chain, checked_latency
    return dp


@pytest.mark.parametrize("overlap", [False, True])
def test_the_rest_chain_bound_is_below_the_plans_latency(overlap):
    checks = 0
    rng = random.Random(3)
    cases = [(random_profile(rng, rng.randint(6, 12)), cluster(s, d, inter=rng.choice([3e9, 1e8])), 32, 8)
             for s, d in [(2, 4), (4, 2), (2, 3), (3, 2)] * 8]
    for prof, c, g, b in cases:
        dp = _checked(DPSearch(prof, c, g, b, SearchConfig("refined", overlap), float("inf")))
        dp.run()
        checks += getattr(dp, "checks", 0)
    assert checks >= 500, checks


def test_formula_2_quick_floor_is_below_the_plans_latency():
    """Under formula 2 the DP rejects a completed plan unpriced by quick_floor (M (F + B) of its stages and
    transfers): turned into an assertion, it stays at most formula 2's L of every plan the DP meets, on
    pivot_hides_allreduce and instances of its kind."""
    checks = 0
    for prof, c, g, b in [pivot_hides_allreduce(), *hidden_allreduce_instances(4, 8)]:
        dp = DPSearch(prof, c, g, b, SearchConfig("paper"), float("inf"))
        quick_floor, latency = dp.pruner.quick_floor, dp.costs.latency

        def checked_quick_floor(*args, dp=dp, quick_floor=quick_floor):
            dp.pending = quick_floor(*args)
            return -float("inf")

        def checked_latency(*args, dp=dp, latency=latency, **kwargs):
            nonlocal checks
            lat, pol = latency(*args, **kwargs)
            bound, dp.pending = getattr(dp, "pending", None), None
            if bound is not None:
                assert bound <= lat * (1 + 1e-9), (bound, lat)
                checks += 1
            return lat, pol
        dp.pruner.quick_floor, dp.costs.latency = checked_quick_floor, checked_latency
        dp.run()
    assert checks >= 100, checks


def _every_plan(prof, c, g, b, overlap=False):
    """(spans, PipelineCosts with K, D, refined L) of every plan of a small instance, both warmup policies."""
    M = g // b
    for spans, pc, D in every_plan(prof, c, M, CostModel(prof, c, b)):
        for pol in ("A", "B"):
            pc.K = warmup_counts(len(spans), M, pol, max_in_flight=D)
            yield spans, pc, D, pc.latency("refined", overlap).total


def _period_ts(dp, pc, D, k, new=False):
    """period_rest's t per stage-count bucket of the rest after the plan's first k stages (``new``: and stage k,
    as Pruner.ends adds it with its bucket's share, pruner.new_share), at least what the search knows
    (Pruner.period_ts: the prefix's U with K at most 2 (stages from it) - 1, D and M; the last bucket with the
    plan's own stage count), raised to every stage's max(F, B) and the plan's link period."""
    M, C, S = dp.M, dp.pruner.counts, len(D)
    every = max(max(pc.F[a], pc.B[a]) for a in range(0, len(pc.F), 2))
    before = k + 1 if new else k  # stages before the rest
    ts = []
    for cc in range(C):
        total = before + (cc + 1 if cc < C - 1 else max(C, S - before))
        u = every
        for i in range(k):
            f, b = pc.F[2 * i], pc.B[2 * i]
            kk = min(M, max(1, D[i]), 2 * (total - i) - 1)
            u = max(u, max(f, b) + (M - kk) / (M - 1) * min(f, b))
        t = dp.pruner.period_floor(u, pc.link_period)
        if new:
            f, b = pc.F[2 * k], pc.B[2 * k]
            t = max(t, max(f, b) + dp.pruner.new_share[cc] * min(f, b))
        ts.append(t)
    return ts


@pytest.mark.parametrize("overlap", [False, True])
def test_the_bounds_below_the_cut_hold_for_every_prefix_of_every_plan_below_it(monkeypatch, overlap):
    """After tighten(): for every plan below the bar and every split into stages so far + the rest, the round
    trip so far + the period bound of the rest (with the plan's own periods and stage count, the most the
    search can know) is at most L, and so are the rest bounds Q and Qar restricted to stages below the bar."""
    monkeypatch.setattr(tuning, "TUNING", tuning.TUNING.replace(period_min_m=4))  # the bound holds from M = 4 on
    checked = excluded = 0
    counts = set()
    cases = small_instances(5, 100, max_layers=5, inter=(3e9, 1e8), memory=(16e9, 3e9), batches=(32, 64),
                            micro=(2, 4, 8))
    for prof, c, g, b in cases:
        plans = list(_every_plan(prof, c, g, b, overlap))
        if not plans:
            continue
        bar = min(lat for *_, lat in plans) * 1.2
        dp = DPSearch(prof, c, g, b, SearchConfig("refined", overlap), bar)
        dp.pruner.tighten(buckets=True)
        assert dp.pruner.has_period_bound and dp.root_bound <= bar
        counts.add(dp.pruner.counts)
        for spans, pc, D, lat in plans:
            if lat >= bar:
                excluded += 1
                continue
            for k in range(len(spans)):  # stages [0, k) planned, [k, S) the rest
                j, R = spans[k][0], c.num_devices - sum(len(lay) for _, _, lay in spans[:k])
                W, Bsum = sum(pc.F[:2 * k - 1]) if k else 0.0, sum(pc.chain[:2 * k - 1]) if k else 0.0
                assert W + Bsum + dp.pruner.period_rest(j, R, _period_ts(dp, pc, D, k)) <= lat * (1 + 1e-9), (spans, k)
                assert W + max(Bsum + dp.pruner.Q[j][R], dp.pruner.Qar[j][R]) <= lat * (1 + 1e-9), (spans, k)
                checked += 1
                if k + 1 < len(spans):  # as Pruner.ends: stage k new, [k + 1, S) the rest
                    j2, R2 = spans[k + 1][0], R - len(spans[k][2])
                    way = sum(pc.F[:2 * k + 1]) + sum(pc.chain[:2 * k + 1])
                    assert way + dp.pruner.period_rest(j2, R2, _period_ts(dp, pc, D, k, True)) <= lat * (1 + 1e-9), \
                        (spans, k)
    assert max(counts) >= 4, counts  # stage-count buckets exercised (bound_tables.period_sums' counts)
    assert checked >= 2000 and excluded >= 1000, (checked, excluded)


def test_the_prefix_u_table_is_the_largest_u_of_the_prefix_stages():
    """bounds.prefix_u_table (built stage by stage from the parent's) equals its definition: the largest over the
    prefix's stages b of max(F_b, B_b) + (M - K) / (M - 1) min(F_b, B_b), K = min(2 (S - b) - 1, D_b, M) for S =
    depth + more stages, for every count of stages after the prefix."""
    rng = random.Random(5)
    for _ in range(200):
        M = rng.choice([2, 3, 8, 16, 64])
        pre = Prefix(latency=0.0)
        for depth in range(1, rng.randint(2, 9)):
            f, b, d = rng.uniform(0, 5), rng.uniform(0, 5), rng.choice([0, 1, 2, 5, 40, 100])
            c = pre.costs
            F, B = c.F + ([rng.uniform(0, 1)] if depth > 1 else []) + [f], c.B + ([0.5] if depth > 1 else []) + [b]
            pre = Prefix(parent=pre, depth=depth, costs=c._replace(F=F, B=B, D=c.D + [d]), latency=0.0)
        table = prefix_u_table(pre, M)
        for more in range(80):
            u = table[min(more, len(table) - 1)]
            want = 0.0
            for j in range(pre.depth):
                f, b = pre.costs.F[2 * j], pre.costs.B[2 * j]
                k = min(2 * (pre.depth + more - j) - 1, max(1, pre.costs.D[j]), M)
                want = max(want, max(f, b) + (M - k) / (M - 1) * min(f, b))
            assert u == pytest.approx(want, rel=1e-12, abs=1e-12), (M, pre.depth, more)


def test_the_rest_tables_are_built_once_per_cut(monkeypatch):
    """bound_tables() builds Q and Qar for the bar the search starts with; tighten() builds them again only once
    the bar has fallen (each build is two rest_bound calls)."""
    calls = []
    real = bounds.rest_bound
    monkeypatch.setattr(bounds, "rest_bound", lambda *a, **k: calls.append(k["bar"]) or real(*a, **k))
    prof = random_profile(random.Random(2), 6)
    c = cluster(2, 2, intra=5e10, inter=1e9)
    dp = DPSearch(prof, c, 64, 8, SearchConfig("refined"), 500.0)
    dp.bound_tables()
    dp.bound_tables()
    dp.pruner.tighten()
    assert calls == [500.0, 500.0]
    dp.set_best(400.0, None)
    dp.pruner.tighten()
    assert calls == [500.0, 500.0, 400.0, 400.0]
    assert dp.root_bound >= max(dp.pruner.Q[0][dp.G], dp.pruner.Qar[0][dp.G])


def test_no_allreduce_table_when_the_rest_table_prunes_the_root(monkeypatch):
    """Where Q[0][G] reaches the bar no plan is below it: Qar is not built (left 0, still a lower bound), and
    the search ends at its root with nothing found."""
    calls = []
    real = bounds.rest_bound
    monkeypatch.setattr(bounds, "rest_bound", lambda *a, **k: calls.append(k.get("allreduce", False))
                        or real(*a, **k))
    prof = random_profile(random.Random(2), 6)
    c = cluster(2, 2, intra=5e10, inter=1e9)
    low = DPSearch(prof, c, 64, 8, SearchConfig("refined"), float("inf"))
    low.bound_tables()
    q0 = low.pruner.Q[0][low.G]
    dp = DPSearch(prof, c, 64, 8, SearchConfig("refined"), q0)
    calls.clear()
    dp.run()
    assert calls == [False] and dp.best[1] is None and dp.states == 1
    assert dp.root_bound >= q0 and max(map(max, dp.pruner.Qar)) == 0.0
    dp = DPSearch(prof, c, 64, 8, SearchConfig("refined"), q0 * 1.5)
    calls.clear()
    dp.bound_tables()
    assert calls == [False, True]
