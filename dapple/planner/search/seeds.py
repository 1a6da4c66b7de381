"""Seed plans for the DP's first bar: even splits on consecutive devices or over the last servers, cuts refined."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .. import tuning
from ..model.cost import ServerLayout
from .pricing import StageCosts
from .records import Incumbent

if TYPE_CHECKING:
    from ..model.cost import CostModel


def consecutive_layouts(reps: Sequence[int], per_server: int) -> list[ServerLayout]:
    """Stages taking consecutive device ids (0, 1, ...), as server layouts."""
    lays, d = [], 0
    for r in reps:
        lays.append(tuple((d + k) // per_server for k in range(r)))
        d += r
    return lays


def work_cuts(rho: Sequence[float], reps: Sequence[int]) -> list[int]:
    """Cuts giving each stage a share of the least work ``rho`` (prefix sums per layer) proportional to its
    replicas."""
    N, G, S = len(rho) - 1, sum(reps), len(reps)
    cuts, a = [], 0
    for i in range(S - 1):
        target = rho[N] * sum(reps[: i + 1]) / G
        c = a + 1
        while c < N - (S - 1 - i) and rho[c] < target:
            c += 1
        cuts.append(c)
        a = c
    return cuts


def balanced_cuts(cm: "CostModel", reps: Sequence[int]) -> list[int] | None:
    """Cuts balancing the stages' F + B on their slices: bisection on the period P, each stage greedily taking
    layers while it stays within P. The min-max partition where every stage has the same replica count; with
    unequal counts a heuristic (taking fewer layers early can move an expensive layer off a slow stage)."""
    N, S = cm.num_layers, len(reps)
    of_rows: dict = {}  # slice rows -> prefix sums of F + B (a pattern has one or two replica counts)
    sums = []
    for r in reps:
        rows = cm.rows(r)
        if rows not in of_rows:
            f, b, _ = cm.prefix_sums(rows)
            of_rows[rows] = [x + y for x, y in zip(f, b)]
        sums.append(of_rows[rows])

    def cover(P: float) -> list[int] | None:
        cuts, a = [], 0
        for i in range(S - 1):
            pre = sums[i]
            base = pre[a]
            if pre[a + 1] - base > P:
                return None
            # the last c in [a + 1, N - (S - 1 - i)] with pre[c] <= base + P (nondecreasing in c)
            a = bisect.bisect_right(pre, base + P, a + 1, N - S + i + 2) - 1
            cuts.append(a)
        return cuts if sums[-1][N] - sums[-1][a] <= P else None

    lo, hi = 0.0, max(s[N] for s in sums)
    best = cover(hi)
    if best is None:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        got = cover(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def replica_patterns(devices: int, per_server: int) -> Iterator[list[int]]:
    """Replicas per stage of the seeds: for every stage count S, G/S each (the first G mod S one more); then
    one stage per server with k servers split into two halves, at the end or at the start (k = 1..servers)."""
    G = devices
    for S in range(1, G + 1):
        yield [G // S + (1 if i < G % S else 0) for i in range(S)]
    servers, half = G // per_server, per_server // 2
    if per_server < 2 or servers < 2 or G % per_server:
        return
    for k in range(1, servers + 1):
        halves = [half, per_server - half] * k
        yield [per_server] * (servers - k) + halves
        if k < servers:
            yield halves + [per_server] * (servers - k)


def scatter_layouts(servers: int, per_server: int) -> Iterator[list[ServerLayout]]:
    """Scatter First seeds: one stage per server on the first servers, then the last k (2, 4, 8, ...) shared by
    stages that each take q devices on every one of them, q = [d, ..., d] or halved at the ends [d/2, d, ..., d/2]
    for d a proper divisor of ``per_server``. The transfers between them stay inside servers and their AllReduce
    rings cross all k. The best plans of deep uniform stacks on many servers end so (e.g. 4, 8, 8, 8, 4 replicas over
    the last 4 servers), which the consecutive seeds miss."""
    qs = []
    for d in range(1, per_server):
        if per_server % d == 0:
            qs.append([d] * (per_server // d))
            if d % 2 == 0:
                qs.append([d // 2] + [d] * (per_server // d - 1) + [d // 2])
    k = 2
    while k <= servers:
        front = [(s,) * per_server for s in range(servers - k)]
        for q in qs:
            yield front + [tuple(s for s in range(servers - k, servers) for _ in range(x)) for x in q]
        k *= 2


def seed_layouts(devices: int, per_server: int, most: int, micro: int) -> Iterator[list[ServerLayout]]:
    """The seeds' stage layouts of at most ``most`` stages of at most ``micro`` replicas (one per micro-batch row):
    every replica pattern (:func:`replica_patterns`) on consecutive devices, then :func:`scatter_layouts`."""
    for reps in replica_patterns(devices, per_server):
        if len(reps) <= most and max(reps) <= micro:  # (before the layouts: 128 x 8 has 1024-stage patterns)
            yield consecutive_layouts(reps, per_server)
    if devices % per_server == 0:
        for lays in scatter_layouts(devices // per_server, per_server):
            if len(lays) <= most and max(map(len, lays)) <= micro:
                yield lays


def even_seeds(cm: "CostModel", rho: Sequence[float], devices: int, per_server: int,
               max_stages: int | None = None) -> Iterator[tuple]:
    """For every layout pattern (:func:`seed_layouts`) of at most ``max_stages`` stages, cut by work share and by
    balanced stage time; yields spans ((a, c, layout), ...)."""
    N = cm.num_layers
    for lays in seed_layouts(devices, per_server, N if max_stages is None else min(N, max_stages), cm.micro):
        reps = [len(lay) for lay in lays]
        seen = set()
        for cuts in (work_cuts(rho, reps), balanced_cuts(cm, reps)):
            if cuts is None or tuple(cuts) in seen:
                continue
            seen.add(tuple(cuts))
            bounds = [0] + list(cuts) + [N]
            yield tuple((bounds[i], bounds[i + 1], lays[i]) for i in range(len(reps)))


def refine_cuts(latency: Callable[[tuple], float | None], spans: tuple, budget: int = 400) -> tuple[float, tuple]:
    """Local search over the cuts of ``spans`` (layouts kept): move one cut, or every cut from or up to one,
    by 2 layers then 1 while ``latency`` (None: infeasible) improves, at most ``budget`` evaluations. Balanced
    stage times are not the fastest plan: the last stage's chain is longer, so it wants fewer layers."""
    cuts = [a for a, _, _ in spans] + [spans[-1][1]]
    lays = [lay for _, _, lay in spans]
    S = len(lays)
    first = latency(spans)
    best = float("inf") if first is None else first
    moves = ([(i, i + 1) for i in range(1, S)] + [(i, S) for i in range(1, S - 1)]
             + [(1, i + 1) for i in range(2, S)])  # cuts[lo:hi] move together
    for step in (2, 1):
        improved = True
        while improved and budget > 0:
            improved = False
            for lo, hi in moves:
                for d in (-step, step):
                    new = cuts[:lo] + [c + d for c in cuts[lo:hi]] + cuts[hi:]
                    if new[lo - 1] >= new[lo] or new[hi - 1] >= new[hi]:
                        continue
                    budget -= 1
                    lat = latency(tuple((new[i], new[i + 1], lays[i]) for i in range(S)))
                    if lat is not None and lat < best:
                        best, cuts, improved = lat, new, True
                    if budget <= 0:
                        break
                if budget <= 0:
                    break
    return best, tuple((cuts[i], cuts[i + 1], lays[i]) for i in range(S))


class Seeder:
    """A few simple complete plans give the search's bound something to prune with: the even-split seeds
    (:func:`even_seeds`), the best the incumbent, the best SearchTuning.refined_seeds kept for
    :meth:`refine_seeds`."""

    def __init__(self, costs: StageCosts, rho: Sequence[float], devices: int, per_server: int,
                 max_stages: int | None, incumbent: Incumbent):
        self.cm, self.M, self.refined = costs.cm, costs.M, costs.refined  # (priced by ``costs``)
        self.rho, self.G, self.dps, self.max_stages = rho, devices, per_server, max_stages
        self.costs, self.incumbent = costs, incumbent
        self.kept: list = []  # (L, spans) of the best seed plans, for refine_seeds
        self.priced = 0  # seed plans seed() priced (the rest were past its bound)

    def seed(self) -> None:
        """Price the seeds in order of a cheap lower bound (:meth:`seed_bound`) and only while it is below the
        SearchTuning.refined_seeds-th best priced so far (a plan past it could be neither): the same incumbent and
        kept seeds as pricing them all, in generation order (the first of equal L wins)."""
        spans_of = list(even_seeds(self.cm, self.rho, self.G, self.dps, self.max_stages))
        found = self._price(spans_of)
        self.priced = len(found)
        for lat, _, spans, pol in sorted(found, key=lambda x: x[1]):  # generation order
            self.incumbent.offer(lat, spans, ("even",) * len(spans), pol)
        found.sort(key=lambda x: (x[0], x[1]))
        self.kept = [(lat, spans) for lat, _, spans, _ in found[:tuning.TUNING.refined_seeds]]

    def _price(self, spans_of: list) -> list:
        """(L, generation index, spans, warmup policy) of the seeds that may be among the best kept."""
        bounds = [self.seed_bound(spans) for spans in spans_of]
        most = tuning.TUNING.refined_seeds
        found: list[tuple[float, int, tuple, str]] = []  # the priced seeds
        keep: list[float] = []  # the best REFINED_SEEDS Ls so far
        for i in sorted(range(len(spans_of)), key=bounds.__getitem__):
            if len(keep) >= most and bounds[i] > keep[-1]:
                break  # and every later one: L >= its bound > the kept ones'
            res = self.costs.evaluate_spans(spans_of[i])
            if res is not None:
                found.append((res[0], i, spans_of[i], res[1]))
                keep = sorted(keep + [res[0]])[:most]
        return found

    def seed_bound(self, spans: tuple) -> float:
        """A lower bound on a plan's L under both models from its stages' compute alone: M (F+B) of every stage,
        and one micro-batch's round trip + (M - 1) max(F, B) of every stage (refined; bounds.period_bound)."""
        M = self.M
        fb = [self.cm.compute(a, c, len(lay)) for a, c, lay in spans]
        low = M * max(f + b for f, b in fb)
        if self.refined:
            trip = sum(f + b for f, b in fb)
            low = max(low, trip + (M - 1) * max(f if f > b else b for f, b in fb))
        return low

    def refine_seeds(self) -> None:
        """Local search over the cuts of the kept seeds (:func:`refine_cuts`), once: a near-optimal incumbent
        before the DP prunes far more of its states."""
        evaluate = self.costs.evaluate_spans
        for _, spans in self.kept:
            lat, spans = refine_cuts(lambda sp: (evaluate(sp) or (None,))[0], spans)
            res = evaluate(spans) if lat < self.incumbent.latency else None
            if res is not None:
                self.incumbent.offer(res[0], spans, ("even",) * len(spans), res[1])
        self.kept = []
