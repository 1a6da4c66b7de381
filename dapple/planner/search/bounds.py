"""The search's bounds behind one interface, Pruner: the least L any completion of a prefix can have."""

from __future__ import annotations

import bisect
from math import inf as INF
from math import nextafter
from typing import TYPE_CHECKING

import numpy as np

from ...core.schedule import most_warmup, most_warmups, policy_warmup
from .. import tuning
from .bound_tables import (
    allreduce_floor,
    efficient_replicas,
    least_work,
    period_bound,
    period_cells,
    rest_bound,
    stage_u,
)
from .records import Prefix, StageEnd, StageLists, Start, Tail

if TYPE_CHECKING:
    from ..model.transfers import CommLinks
    from .bound_tables import PeriodRows
    from .pricing import StageCosts
    from .transitions import Arrival

# the most K the stage before the last can have (two stages from it to the last: policy B's 3)
NEXT_TO_LAST_K = policy_warmup("B", 2)

__all__ = ["Pruner", "allreduce_floor", "efficient_replicas", "least_work", "prefix_lead", "prefix_u_table",
           "rest_bound"]


def prefix_lead(pre: Prefix, M: int) -> tuple[float, float]:
    """The least ``lead`` and own-chain terms of the prefix's stages in a plan of pre.depth + 2 stages, each with
    the most K it can have (:meth:`Pruner.rest_chain` reads them; cached on the prefix)."""
    S = pre.depth + 2
    F, B, D = pre.costs.F, pre.costs.B, pre.costs.D
    lead = own = 0.0
    for j in range(pre.depth):
        k = most_warmup(S - j, D[j], M)
        f, b = F[2 * j], B[2 * j]
        lead = max(lead, (M - 1) * f + (M - k) * b)
        own = max(own, (M - k) * f + (M - 1) * b)
    pre.lead = (lead, own)
    return lead, own


def prefix_u_table(pre: Prefix, M: int) -> list:
    """The largest U = max(F, B) + (M - K) / (M - 1) min(F, B) over the prefix's stages per count of stages after
    it (the last entry: that many or more), K the most each stage's can be: what the period bound starts from.
    Built from the parent's table and the last stage; cached on the prefix."""
    us = pre.u_table
    if us is not None:
        return us
    if pre.parent is None or M <= 1:
        us = pre.u_table = [0.0]
        return us
    up = prefix_u_table(pre.parent, M)  # the parent's more = this prefix's more + 1 (the same S)
    a = 2 * (pre.depth - 1)
    f, b = pre.costs.F[a], pre.costs.B[a]
    hi, lo = (f, b) if f > b else (b, f)
    d, m1 = pre.costs.D[-1], M - 1
    cap = most_warmup(M, d, M)  # min(D, M): K of the last stage, b = depth - 1, with M or more stages from it
    last = len(up) - 1
    n = max(last, cap // 2 + 1)  # (K is cap from more = cap // 2 on)
    us = []
    for more, k in enumerate(most_warmups(n, d, M)):  # (more + 1 stages from the last one)
        x = hi + (M - k) / m1 * lo
        y = up[more + 1 if more + 1 < last else last]
        us.append(x if x > y else y)
    pre.u_table = us
    return us


class Pruner:
    """Lower bounds on L of any completion of a prefix, for one cost model, M micro-batches on G devices: the
    interface the DP prunes through (:meth:`prunes` a state, :meth:`first_end` and :meth:`ends` of a new stage,
    :meth:`quick_floor` and :meth:`rest_chain` of a plan), over the tables of bound_tables.py.

    Q[j][R]: the least that layers [j, N) on R devices add to L under any split (rest_bound); Qar[j][R]: the same
    with each stage's least AllReduce and only forwards before it; Qcol[R][j] = -Q[j][R] (and Qarcol), increasing
    in j, for bisect. ``pv``: the period bound's tables, made by :meth:`tighten`. ``root_bound``: no plan below the
    bar has L below it."""

    def __init__(self, costs: "StageCosts", devices: int, rho: list):
        cm = costs.cm
        self.cm, self.M, self.G, self.N, self.rho = cm, costs.M, devices, cm.num_layers, rho
        self.refined, self.overlap = costs.refined, costs.overlap
        self.costs, self.incumbent = costs, costs.incumbent
        # refined: a stage's chain ends with the longer of the way down and its AllReduce; overlapped, the AllReduce
        # ends E >= AR after its last backward starts (CostModel.overlapped_ending), so at least AR - B after it ends
        self.ar_less = 1.0 if self.overlap else 0.0  # x B: what of a stage's AllReduce its last backward may hide
        self.fill = 1.0 if self.refined else 0.0
        self.tables_bar: float | None = None  # the bar Q and Qar were made for
        # the rest bounds' tables (rest_tables makes them)
        self.Q: list[list[float]] = []
        self.Qcol: list[list[float]] = []
        self.Qar: list[list[float]] = []
        self.Qarcol: list[list[float]] = []
        self.pv: tuple[list, PeriodRows] | None = None
        self.has_period_bound = False  # whether :meth:`tighten` made the period bound's tables (pv)
        self.counts = 1  # period_bound's stage-count buckets (tighten() sets them)
        self.new_share: list = [0.0]
        self.root_bound = 0.0

    # ---- the tables ------------------------------------------------------------------------------------------
    def rest_tables(self, bar: float) -> None:
        """Q and Qar for plans below ``bar`` (made again only for a new bar); Qar is left 0 where Q alone puts every
        plan at or above it (the search ends at its root)."""
        if self.tables_bar == bar:
            return  # the same tables
        self.tables_bar = bar
        ov = self.overlap
        q = rest_bound(self.cm, self.M, self.G, fill=self.refined, bar=bar, overlap=ov, chain_allreduce=self.refined)
        self.Q = q.tolist()
        self.Qcol = (-q.T).tolist()
        qa = (rest_bound(self.cm, self.M, self.G, fill=True, allreduce=True, bar=bar, overlap=ov)
              if self.refined and q[0, self.G] < bar else np.zeros_like(q))
        self.Qar = qa.tolist()
        self.Qarcol = (-qa.T).tolist()

    def bound_tables(self) -> None:
        """The rest bounds' tables for plans below the bar as it is now (not made again by tighten() unless the bar
        falls) and the root bound."""
        self.rest_tables(self.incumbent.bar)
        # no plan below the bar has L below this (after tighten(): below the bar then)
        self.root_bound = max(self.root_bound, self.Q[0][self.G], self.Qar[0][self.G])

    def tighten(self, buckets: bool = False) -> None:
        """Once the search is large (SearchTuning.tighten_after states) it pays for tighter tables: the rest bounds
        for plans below the bar only, and the period bound's; with ``buckets`` (SearchTuning.buckets_after) per
        count of the rest's stages too."""
        bar = self.incumbent.bar
        if not self.refined or bar == INF:
            return
        self.rest_tables(bar)
        M = self.M
        lo, hi = self.rho[self.N] / self.G / 2, bar / (M - 1) if M > 3 else 0.0  # beyond hi: L >= bar
        # the tables' numpy work: period_cells elements per threshold and stage-count bucket; within period_work,
        # up to period_counts buckets (at most M / 4: K <= 2 x stages - 1 nears M only past M / 2 stages) and
        # period_thresholds thresholds, fewer buckets first
        tune = tuning.TUNING
        pairs = tune.period_work // max(1, period_cells(self.cm, M, self.G, bar, self.overlap))
        C = max(1, min(tune.period_counts, M // 4, pairs // 24)) if buckets else 1
        K = min(tune.period_thresholds, pairs // C)
        if hi > lo and K >= 4 and M >= tune.period_min_m:
            self.pv = period_bound(self.cm, M, self.G, lo, hi, K, bar=bar, overlap=self.overlap, counts=C)
            self.has_period_bound = True
            self.counts = C
            # the new stage's share of min(F, B) in its U (bound_tables.stage_u) per bucket of the rest after it
            self.new_share = [stage_u(M, c + 2 if c < C - 1 else None) for c in range(C)]
        self.root_bound = max(self.root_bound, self.Q[0][self.G], self.Qar[0][self.G],
                              self.period_rest(0, self.G, [0.0] * self.counts) if self.pv is not None else 0.0)

    # ---- a DP state and a new stage after it -----------------------------------------------------------------
    def prunes(self, pre: Prefix, j: int, R: int) -> bool:
        """Whether no completion of ``pre`` (layers [0, j) planned, R >= 2 devices free) can beat the bar: the rest's
        least work over the free devices, the rest bounds, the period bound."""
        N, M, rho, bar = self.N, self.M, self.rho, self.incumbent.bar
        if max(pre.lb, M * (rho[N] - rho[j]) / R) >= bar:
            return True
        W, Bsum = pre.forward_sum, pre.backward_sum
        if W + max(Bsum + self.Q[j][R], self.Qar[j][R]) >= bar:
            return True
        if self.pv is None:
            return False
        ts = self.period_ts(pre, 0, min(R, N - j), max(pre.links.server_max, pre.links.dev))
        return W + Bsum + self.period_rest(j, R, ts, add=W + Bsum, stop=bar) >= bar

    def first_end(self, pre: Prefix, j: int, m: int, n_rest: int, bar: float) -> int | None:
        """The first end j2 a new stage [j, j2) on m replicas after ``pre`` may take, ``n_rest`` devices left for
        the rest: M rho(j2, N) / n_rest < bar and Q, Qar of [j2, N) within it (None: none, or the stage alone,
        M (F + B), reaches it)."""
        N, M, rho, W = self.N, self.M, self.rho, pre.forward_sum
        lo = bisect.bisect_right(rho, rho[N] - bar * n_rest / M, j + 1)
        lo = max(lo, bisect.bisect_right(self.Qcol[n_rest], W + pre.backward_sum - bar, j + 1),
                 bisect.bisect_right(self.Qarcol[n_rest], W - bar, j + 1))
        if lo >= N or M * sum(self.cm.compute(j, lo, m)) >= bar:
            return None
        return lo

    def ends(self, new: StageLists, n_rest: int, start: Start, lo: int, ts: list | None = None,
             first: bool = False) -> list[StageEnd]:
        """The ends j2 >= ``lo`` of a new stage (``new``: its costs per end, StageCosts.stage_costs) from ``start``,
        ``n_rest`` devices left for the rest, that pass the bounds, each with the least L of the stages up to it and
        of a completion by the rest bounds (raised to the period bound where ``ts``, period_rest's t per bucket of the
        rest, is given). ``first``: only the first such end."""
        N, M, bar, Q, Qar, fill = self.N, self.M, self.incumbent.bar, self.Q, self.Qar, self.fill
        fs, bs, ars, ds = new
        refined, ar_less = self.refined, self.ar_less
        base, W, Bsum = start
        pv = self.pv is not None and ts is not None
        tsl: list = ts if ts is not None else []  # (ts, where pv)
        out, make = [], tuple.__new__  # (a StageEnd without NamedTuple's Python-level __new__: 100k on 8 x 8)
        for j2 in range(lo, min(N, len(fs))):  # the lists end where M (F+B) alone reaches the bar
            f, b, ar = fs[j2], bs[j2], ars[j2]
            lb = max(base, W + M * (f + b) + (max(Bsum, ar - ar_less * b) if refined else Bsum))
            if lb >= bar:
                break  # a longer new stage is only slower
            fits = ds[j2]
            if fits < 1:
                break  # and only bigger
            # the rest [j2, N) on the free devices: the least any split of it adds (bound_tables.rest_bound)
            low = W + max(Bsum + fill * (f + b) + Q[j2][n_rest], f + Qar[j2][n_rest])
            if low >= bar:
                continue
            if pv:
                low = self.with_period(low, j2, f, b, n_rest, tsl, start)
                if low >= bar:
                    continue
            out.append(make(StageEnd, (j2, f, b, ar, fits, lb, low)))
            if first:
                break
        return out

    # ---- a plan: prefix + new stage + the rest as one stage ---------------------------------------------------
    def below(self, pre: Prefix, chain_in: float | None, b: float, ar: float, e: float) -> float:
        """refined_chains' `below` after a new stage (B ``b``, AllReduce ``ar``, overlapped ending ``e``) that
        follows ``pre`` over a transfer whose gradients take ``chain_in`` back (None: no stage before)."""
        own = e if self.overlap else b + ar
        below = pre.below
        if below is None or chain_in is None:
            return own
        below += chain_in
        return below + b if below + b > own else own

    def quick_floor(self, end: StageEnd, link: "CommLinks", rest: Tail, start: Start) -> float:
        """A cheap lower bound on L of prefix + new stage + the rest as one stage: formula 2, M (F+B) of a stage;
        refined, the rest's chain without its waits (:meth:`rest_chain` is the full one)."""
        M, f, b, busy, chain = self.M, end.f, end.b, link.busiest, link.chain
        t_f, t_b, t_ar, t_e, _ = rest
        if not self.refined:
            return max(M * (t_f + t_b), M * (f + b), 2 * M * busy)
        return start.forward_sum + f + busy + M * (t_f + t_b) + max(t_e - t_b if self.overlap else t_ar,
                                                                   start.backward_sum + b + chain)

    def rest_chain(self, arr: "Arrival", end: StageEnd, link: "CommLinks", rest: Tail, e: float,
                   link_period: float) -> float:
        """A lower bound on L of prefix + new stage + the rest as one stage: the rest's own chain in refined_chains
        from what is known without the window terms, or any other stage's (prefix_lead). Nearly every plan's pivot
        is its last stage: the search rejects most plans here without pricing them."""
        M, pre, chain_in = self.M, arr.pre, arr.chain
        f, b, ar, busy, chain = end.f, end.b, end.allreduce, link.busiest, link.chain
        t_f, t_b, t_ar, t_e, _ = rest
        below = self.below(pre, chain_in, b, ar, e) + chain
        own = t_e if self.overlap else t_b + t_ar
        tail = below if below > own - t_b else own - t_b
        supply = max(pre.fmax, arr.busy, f, busy, t_f)
        pace = max(f + b, t_f + t_b, link_period)
        up = NEXT_TO_LAST_K if M > NEXT_TO_LAST_K else M
        arrive = min(min(M - 1, up - 1) * supply + (M - up) * pace, (M - 1) * pace)
        lead, own = pre.lead if pre.lead is not None else prefix_lead(pre, M)
        k = NEXT_TO_LAST_K if M > NEXT_TO_LAST_K else M  # the new stage's K at most
        arrive = max(arrive, lead, (M - 1) * f + (M - k) * b)
        steady = max((M - 1) * (t_f + t_b), arrive + t_f - t_f)  # in refined_chains' order of operations
        trip = arr.start.forward_sum + f + busy + t_f + t_b
        bsum = pre.backward_sum + (chain_in if chain_in is not None else 0.0) + b + chain + t_b
        return max(trip + steady + tail, trip - t_b + bsum + max(own, (M - 1) * b + (M - k) * f))

    # ---- the period bound --------------------------------------------------------------------------------------
    def period_floor(self, u: float, links: float) -> float:
        """t for :meth:`period_rest` after stages whose largest U is ``u`` and whose links take at least ``links``
        ms per micro-batch (forwards reach the last stage one per link period)."""
        M = self.M
        k = NEXT_TO_LAST_K
        x = links * (M - k) / (M - 1) if M > k else 0.0
        return u if u > x else x

    def period_ts(self, pre: Prefix, after: int, most: int, links: float) -> list:
        """period_rest's t per stage-count bucket of the rest after ``pre`` and ``after`` more stages (the last
        bucket: ``most``, as many stages as the rest can have)."""
        C = self.counts
        us = prefix_u_table(pre, self.M)
        last = len(us) - 1
        x = self.period_floor(0.0, links)
        cache = pre.period_ts if pre.period_ts is not None else {}
        pre.period_ts = cache
        head = cache.get((after, links, C))  # the buckets but the last: the same for every ``most``
        if head is None:
            head = []
            for c in range(C - 1):
                more = after + c + 1
                u = us[more if more < last else last]
                head.append(u if u > x else x)
            cache[(after, links, C)] = head
        more = after + (most if most > C else C)
        u = us[more if more < last else last]
        return head + [u if u > x else x]

    def period_rest(self, j: int, R: int, ts: list, *, hi: float = 0.0, lo: float = 0.0, add: float = 0.0,
                    stop: float = -INF) -> float:
        """L - (one micro-batch's round trip so far) is at least this for any split of [j, N) on R devices after
        stages whose largest U is ts[c] and a new stage of max(F, B) ``hi`` and min(F, B) ``lo``: the least over
        the buckets c some split falls in. Once ``add`` + a bucket's value is below ``stop``, that value (a caller
        who only asks whether ``add`` + this reaches ``stop`` gets the same answer sooner)."""
        if self.pv is None:
            raise RuntimeError("Pruner.period_rest: tighten() made no period tables")
        taus, pr = self.pv
        m1, shares = self.M - 1, self.new_share
        best = INF
        rw = pr.rows[j][R]
        for c, V, S in (rw if rw is not None else pr.row(j, R)):
            t = hi + shares[c] * lo
            if ts[c] > t:
                t = ts[c]
            k = bisect.bisect_right(taus, t)
            a = V[k] + m1 * t
            s = S[k + 1]
            if s < a:
                a = s
            if a < best:
                best = a
                if add + a < stop:
                    return a
        return best

    def with_period(self, low: float, j2: int, f: float, b: float, n_rest: int, ts: list, start: Start) -> float:
        """``low`` raised to the period bound of a new stage [j, j2) (F ``f``, B ``b``) from ``start``, before the
        rest [j2, N) on ``n_rest`` devices (period_rest, ``ts`` from period_ts)."""
        hi, lo = (f, b) if f > b else (b, f)
        before = start.forward_sum + start.backward_sum + f + b
        x = before + self.period_rest(j2, n_rest, ts, hi=hi, lo=lo, add=before,
                                      stop=nextafter(low, INF))  # (at most low: low)
        return x if x > low else low
