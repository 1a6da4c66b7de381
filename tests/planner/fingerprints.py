"""Fingerprints of the planner's behaviour, for refactors that must not change it: run before and after, compare.

search_hash: every prefix the DP makes (in order, with its floor, bounds and formula 5's L where priced), every
search's result and work, the seeds, the bound tables, the certificates, the final choice and whole plans, on a
fixed set of instances. model_hash: every cost-model output (evaluate's estimates, pipeline costs, simulations) on a
fixed set of plans. Floats are hashed by repr (bit for bit).

    PYTHONPATH=$PWD python tests/planner/fingerprints.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import dapple  # noqa: E402
from dapple.core.plan import Plan, Stage  # noqa: E402
from dapple.core.schedule import warmup_counts  # noqa: E402
from dapple.planner import evaluate, simulate  # noqa: E402
from dapple.planner.judge import choose  # noqa: E402
from dapple.planner.model.cost import CostModel  # noqa: E402
from dapple.planner.model.evaluate import pipeline_costs  # noqa: E402
from dapple.planner.search import records  # noqa: E402
from dapple.planner.search.bound_tables import period_bound, rest_bound  # noqa: E402
from dapple.planner.search.dp import DPSearch, SearchConfig  # noqa: E402
from dapple.planner.search.exact import exact_search, priced_plans  # noqa: E402
from tests.planner.helpers import cluster, random_candidates, random_profile, small_instances  # noqa: E402


class Digest:
    def __init__(self):
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, *items) -> None:
        self.h.update(repr(_plain(items)).encode())
        self.n += 1

    def hex(self) -> str:
        return self.h.hexdigest()[:16]


def _plain(x):
    """Records as plain tuples (their class and field names are not behaviour)."""
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _prefix_facts(p) -> tuple:
    """What a prefix says: its stage, state, bounds, formula 5's L where priced, its stages' F and B."""
    return (p.depth, tuple(p.span) if p.span is not None else None, p.perm, p.free, p.lb, p.floor, p.latency,
            p.policies, tuple(p.costs.F), tuple(p.costs.B), p.forward_sum, p.backward_sum, p.below, p.fmax)


def hook_prefixes(digest: Digest):
    """Record every Prefix the search makes, in order (its __init__ wrapped)."""
    cls = records.Prefix
    init = cls.__init__

    def recorded(self, *a, **k):
        init(self, *a, **k)
        if self.parent is not None:
            digest.add("prefix", _prefix_facts(self))
    cls.__init__ = recorded
    return lambda: setattr(cls, "__init__", init)


def _result(res) -> tuple | None:
    if res is None:
        return None
    return (res.latency, tuple(res.spans), tuple(res.policies), res.warmup_policy, res.micro_batch_size, res.states,
            res.transitions)


def search_instances(quick: bool):
    """(profile, cluster, global batch, micro-batch, SearchConfig, seed) of the DP runs."""
    out = []
    for prof, c, g, b in small_instances(7, 20 if quick else 45):
        out.append((prof, c, g, b, SearchConfig("refined"), False))
        out.append((prof, c, g, b, SearchConfig("paper", beam=2), False))
    for prof, c, g, b in small_instances(11, 10 if quick else 25):
        out.append((prof, c, g, b, SearchConfig("refined", True), True))
    for prof, c, g, b in small_instances(5, 6 if quick else 15, memory=(8e9, 3e9, 1.5e9)):
        out.append((prof, c, g, b, SearchConfig("refined", recompute=True, mixed_precision="fp16"), False))
    rng = random.Random(1)
    for i in range(4 if quick else 30):
        prof = random_profile(rng, rng.randint(8, 16))
        s, d = rng.choice([(2, 4), (4, 2), (3, 2), (2, 3), (6, 2)])
        c = cluster(s, d, intra=5e10, inter=rng.choice([1e9, 3e9, 3e8]), intra_lat=5e-6, inter_lat=3e-5)
        g, b = rng.choice([(64, 4), (64, 8), (128, 8), (32, 4), (256, 16)])
        cfg = SearchConfig("refined", overlap=i % 2 == 0, partial_kinds=1 if s * d > 8 or i % 3 == 0 else None,
                           max_stages=3 if i % 5 == 4 else None, gap=0.03 if i % 7 == 6 else 0.0)
        out.append((prof, c, g, b, cfg, True))
    if not quick:  # a search large enough to tighten its bounds with stage-count buckets (BUCKETS_AFTER states)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from planning_time import synthetic
        out.append((synthetic(128), dapple.Cluster.preset("A", servers=8), 512, 8,
                    SearchConfig("refined", True, partial_kinds=1), True))
    return out


def search_part(d: Digest, quick: bool) -> None:
    undo = hook_prefixes(d)
    try:
        for prof, c, g, b, cfg, seed in search_instances(quick):
            if g % b:
                continue
            dp = DPSearch(prof, c, g, b, cfg, float("inf"))
            if seed:
                dp.seed()
                d.add("seeded", dp.best, dp.seeder.kept, dp.seeder.priced)
                dp.refine_seeds()
                d.add("refined", dp.best)
            dp.run()
            d.add("run", _result(dp.result()), dp.states, dp.transitions, dp.complete, dp.root_bound)
    finally:
        undo()


def tables_part(d: Digest, quick: bool) -> None:
    rng = random.Random(3)
    for k in range(3 if quick else 8):
        prof = random_profile(rng, rng.randint(4, 14))
        c = cluster(rng.choice([1, 2, 4]), rng.choice([2, 4]), memory=rng.choice([1e12, 8e9]))
        cm = CostModel(prof, c, rng.choice([2, 4, 8, 16]))
        for cut in (float("inf"), 300.0):
            for ov in (False, True):
                for ar in (False, True):
                    q = rest_bound(cm, 16, c.num_devices, True, allreduce=ar, bar=cut, overlap=ov)
                    d.add("rest", k, cut, ov, ar, q.tobytes())
        if c.num_devices >= 4:
            taus, rows = period_bound(cm, 16, c.num_devices, 1.0, 30.0, 8, bar=500.0, overlap=True, counts=3)
            d.add("period", k, taus, rows.V.tobytes(), rows.S.tobytes())


def _exact_facts(ex) -> tuple | None:
    """(L, spans, warmup policy) of exact_search's answer (None: not enumerated)."""
    if ex is None:
        return None
    return (ex.latency, ex.found.spans, ex.found.warmup_policy) if ex.found else (ex.latency, (), "A")


def exact_part(d: Digest, quick: bool) -> None:
    rng = random.Random(5)
    for _ in range(3 if quick else 8):
        prof = random_profile(rng, rng.randint(3, 5))
        c = cluster(*rng.choice([(2, 2), (1, 4), (2, 4)]), inter=rng.choice([1e9, 3e8]), intra_lat=5e-6,
                    inter_lat=3e-5)
        for model, overlap in (("paper", False), ("refined", True)):
            cm, cfg = CostModel(prof, c, 4), SearchConfig(model=model, overlap=overlap)
            ex = exact_search(cm, 8, cfg)
            d.add("exact", _exact_facts(ex))
            if c.num_devices <= 4:
                d.add("every", [tuple(x) for x in priced_plans(cm, 8, cfg)])


def choice_part(d: Digest, quick: bool) -> None:
    rng = random.Random(11)
    for i in range(4 if quick else 10):
        prof = random_profile(rng, 8)
        c = cluster(2, 2, intra=5e10, inter=rng.choice([1e9, 3e9]), intra_lat=5e-6, inter_lat=3e-5)
        cands = random_candidates(rng)
        for sch in ("dapple", "auto"):
            v = choose(prof, c, 64, cands, model="refined", overlap=i % 2 == 0, schedule=sch, warmup_policy=None,
                       optimizer_factor=4.0, verify=6)
            ch = v[0]
            d.add("choice", sch, ch.micro_batch_size, ch.spans, ch.policies, ch.warmup_policy, ch.schedule,
                  tuple(v)[1:])


def _plan_facts(p: Plan) -> dict:
    doc = p.to_dict()
    doc.get("meta", {}).pop("planning_time_s", None)
    return doc


def plan_part(d: Digest, quick: bool) -> None:
    cases = [(random_profile(random.Random(3), 10), cluster(2, 2, intra=5e10, inter=3e9), 64, dict()),
             (random_profile(random.Random(5), 12), cluster(4, 2, intra=5e10, inter=1e9, intra_lat=5e-6,
                                                            inter_lat=3e-5), 128, dict()),
             (random_profile(random.Random(2), 12), cluster(6, 2), 48, dict(time_limit=600)),
             (random_profile(random.Random(4), 8), cluster(2, 2, inter=3e8), 64, dict(model="paper", overlap=False)),
             (random_profile(random.Random(1), 7), cluster(2, 4), 32, dict(micro_batch_size=4, verify=0)),
             (random_profile(random.Random(6), 9), cluster(2, 2, inter=1e9, memory=3e9), 64,
              dict(schedule="auto", recompute="auto")),
             (random_profile(random.Random(7), 9), cluster(2, 2, inter=1e9), 64, dict(schedule="zb-h1")),
             (random_profile(random.Random(8), 10), cluster(2, 4, inter=1e9), 64,
              dict(mixed_precision="bf16", gap=0.02))]
    if not quick:
        cases += [(random_profile(random.Random(5), 12), cluster(6, 2, inter=3e8), 48, dict(workers=2)),
                  (random_profile(random.Random(9), 14), cluster(3, 2, inter=3e8), 96, dict(beam=2, max_stages=4))]
    for prof, c, g, kw in cases:
        # in-process and without a time limit unless the case says: "auto" forks and stops by the clock, which the
        # plan does not depend on but its meta (workers, simulations run side by side) does
        kw = {"workers": 1, "time_limit": None, **kw}
        try:
            p = dapple.plan(prof, c, g, **kw)
            d.add("plan", _plan_facts(p))
        except ValueError as e:
            d.add("plan-error", str(e))  # (by its message: its class is a ValueError's subclass or not)


def model_part(d: Digest, quick: bool) -> None:
    rng = random.Random(21)
    for i in range(20 if quick else 60):
        prof = random_profile(rng, rng.randint(3, 10))
        s, per = rng.choice([(1, 4), (2, 2), (4, 1), (2, 4), (3, 2)])
        c = cluster(s, per, intra=rng.choice([5e10, 1e10]), inter=rng.choice([3e9, 1e9, 3e8]), intra_lat=5e-6,
                    inter_lat=3e-5, memory=rng.choice([16e9, 4e9]), link_sharing=rng.choice(["held", "shared"]))
        G, N = c.num_devices, prof.num_layers
        S = rng.randint(1, min(G, N))
        cuts = [0, *sorted(rng.sample(range(1, N), S - 1)), N]
        devs = list(range(G))
        rng.shuffle(devs)
        bounds = [0, *sorted(rng.sample(range(1, G), S - 1)), G]
        b = rng.choice([4, 8, 16])
        stages = [Stage((cuts[k], cuts[k + 1]), sorted(devs[bounds[k]:bounds[k + 1]])) for k in range(S)]
        if any(len(st.devices) > b for st in stages):
            continue
        g = b * rng.choice([2, 4, 8])
        for model in ("paper", "refined"):
            for overlap in (False, True):
                for sch in ("dapple", "gpipe", "zb-h1"):
                    for rc in (None, True, "auto"):
                        mp = rng.choice([None, "bf16"])
                        pol = rng.choice(["A", "B"])
                        try:
                            est = evaluate(prof, c, stages, g, b, model=model, overlap=overlap, schedule=sch,
                                           warmup_policy=pol, recompute=rc, mixed_precision=mp)
                            d.add("est", est.to_dict())
                        except ValueError as e:
                            d.add("est-error", str(e))
        cm = CostModel(prof, c, b)
        spans = [(st.layers[0], st.layers[1], tuple(c.server_of(x) for x in st.devices)) for st in stages]
        pc, D = pipeline_costs(cm, spans, g // b, "B", check=False)
        d.add("pc", pc.F, pc.B, pc.AR, pc.E, pc.K, pc.link_period, pc.chain, pc.window, pc.drain_period, pc.queue,
              pc.feed, D)
        for pol in ("A", "B"):
            d.add("K", warmup_counts(S, g // b, pol, max_in_flight=D))
        try:
            sim = simulate(Plan(g, b, stages, schedule=rng.choice(["dapple", "gpipe", "zb-h1"])), prof, c,
                           overlap=bool(i % 2))
            d.add("sim", sim.latency_ms)
        except ValueError as e:
            d.add("sim-error", str(e))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer instances (a smoke check)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    search, model = Digest(), Digest()
    search_part(search, args.quick)
    tables_part(search, args.quick)
    exact_part(search, args.quick)
    choice_part(search, args.quick)
    plan_part(search, args.quick)
    model_part(model, args.quick)
    np.seterr(all="ignore")
    print(f"search_hash {search.hex()} ({search.n} records)")
    print(f"model_hash {model.hex()} ({model.n} records)")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
