"""The bounds the search prunes with: bounds.py's tables for the cut as it stands, and the rest's own chain."""

from __future__ import annotations

import bisect
from math import inf as INF
from math import nextafter
from typing import TYPE_CHECKING

import numpy as np

from ...core.schedule import most_warmup, most_warmups
from .. import tuning
from .bounds import period_bound, period_cells, rest_bound, stage_u
from .records import Incumbent, Prefix, SearchConfig

if TYPE_CHECKING:
    from ..model.cost import CostModel


def prefix_lead(pre: Prefix, M: int) -> tuple[float, float]:
    """In a plan of pre.depth + 2 stages, the least over the prefix's stages j of: (``lead`` in refined_chains,
    from j's first forward to its last, at least K_j F_j + B_j + (M - 1 - K_j)(F_j + B_j) (K_j < M) or
    (M - 1) F_j; what j's chain adds to the round trip: M - K_j pairs F_j + B_j and K_j backwards after its
    first, at least (M - K_j) F_j + (M - 1) B_j), each at least its value for K = the most K_j can be
    (policy B's 2(S - j) - 1, D_j, M). Cached on the prefix."""
    S = pre.depth + 2
    lead = own = 0.0
    for j in range(pre.depth):
        k = most_warmup(S - j, pre.D[j], M)
        f, b = pre.F[2 * j], pre.B[2 * j]
        lead = max(lead, (M - 1) * f + (M - k) * b)
        own = max(own, (M - k) * f + (M - 1) * b)
    pre.lead = (lead, own)
    return lead, own


def prefix_u_table(pre: Prefix, M: int) -> list:
    """Per count ``more`` = 0, 1, ... of stages after the prefix (the last entry: that many or more, where K_b
    stops growing at D_b or M): the largest over its stages b of U_b = max(F_b, B_b) + (M - K) / (M - 1)
    min(F_b, B_b), K the most K_b can be (policy B's 2(S - b) - 1 with S = depth + more, D_b, M): b's chain
    and the last stage's ``lead`` make L >= the round trip + (M - 1) max + (M - K_b) min (bounds.stage_u).
    Built from the parent's table and the prefix's last stage; cached on the prefix."""
    us = pre.us
    if us is not None:
        return us
    if pre.parent is None or M <= 1:
        us = pre.us = [0.0]
        return us
    up = prefix_u_table(pre.parent, M)  # the parent's more = this prefix's more + 1 (the same S)
    a = 2 * (pre.depth - 1)
    f, b = pre.F[a], pre.B[a]
    hi, lo = (f, b) if f > b else (b, f)
    d, m1 = pre.D[-1], M - 1
    cap = most_warmup(M, d, M)  # min(D, M): K of the last stage, b = depth - 1, with M or more stages from it
    last = len(up) - 1
    n = max(last, cap // 2 + 1)  # (K is cap from more = cap // 2 on)
    us = []
    for more, k in enumerate(most_warmups(n, d, M)):  # (more + 1 stages from the last one)
        x = hi + (M - k) / m1 * lo
        y = up[more + 1 if more + 1 < last else last]
        us.append(x if x > y else y)
    pre.us = us
    return us


class Pruner:
    """Lower bounds on L of any completion of a prefix, for one cost model, M micro-batches on G devices.

    Q[j][R]: least that layers [j, N) on R devices add to L under any split (bounds.rest_bound); Qar[j][R]: the
    same with each stage's least AllReduce and only forwards before it; Qcol[R][j] = -Q[j][R] (and Qarcol),
    increasing in j, for bisect. ``pv``: the period bound's tables (bounds.period_bound), made by :meth:`tighten`.
    ``root_bound``: no plan below the cut has L below it."""

    def __init__(self, cm: "CostModel", config: SearchConfig, M: int, devices: int, rho: list,
                 incumbent: Incumbent):
        self.cm, self.M, self.G, self.N, self.rho = cm, M, devices, cm.num_layers, rho
        self.refined, self.overlap = config.refined, config.overlap
        self.incumbent = incumbent
        # refined: a stage's chain ends with the longer of the way down and its AllReduce; overlapped, the AllReduce
        # ends E >= AR after its last backward starts (CostModel.overlapped_ending), so at least AR - B after it ends
        self.ar_less = 1.0 if config.overlap else 0.0  # x B: what of a stage's AllReduce its last backward may hide
        self.fill = 1.0 if self.refined else 0.0
        self.tables_cut: float | None = None  # the cut Q and Qar were made for
        self.Q = self.Qcol = self.Qar = self.Qarcol = None
        self.pv = None
        self.counts = 1  # period_bound's stage-count buckets (tighten() sets them)
        self.new_share: list = [0.0]
        self.root_bound = 0.0

    def rest_tables(self, cut: float) -> None:
        """Q and Qar for plans below ``cut`` (made again only for a new cut). Qar is used after the first
        micro-batch's forwards W, Q after W + the backwards Bsum. Where Q alone puts every plan at or above the
        cut, Qar is left 0 (the search ends at its root)."""
        if self.tables_cut == cut:
            return  # the same tables
        self.tables_cut = cut
        ov = self.overlap
        q = rest_bound(self.cm, self.M, self.G, fill=self.refined, cut=cut, overlap=ov)
        self.Q = q.tolist()
        self.Qcol = (-q.T).tolist()
        qa = (rest_bound(self.cm, self.M, self.G, fill=True, allreduce=True, cut=cut, overlap=ov)
              if self.refined and q[0, self.G] < cut else np.zeros_like(q))
        self.Qar = qa.tolist()
        self.Qarcol = (-qa.T).tolist()

    def bound_tables(self) -> None:
        """The rest bounds' tables for plans below the cut as it is now (built once, not again by tighten() unless
        the cut falls) and the root bound."""
        self.rest_tables(self.incumbent.cut)
        # no plan below the cut has L below this (after tighten(): below the cut then)
        self.root_bound = max(self.root_bound, self.Q[0][self.G], self.Qar[0][self.G])

    def tighten(self, buckets: bool = False) -> None:
        """Once the search is large (SearchTuning.tighten_after states): the rest bounds again, now for plans below
        the cut only (bounds.rest_bound's ``cut``: no stage whose own chain reaches it), and the period bound's tables
        (bounds.period_bound); with ``buckets`` (a larger search: SearchTuning.buckets_after states) per count of the
        rest's stages too."""
        cut = self.incumbent.cut
        if not self.refined or cut == INF:
            return
        self.rest_tables(cut)
        M = self.M
        lo, hi = self.rho[self.N] / self.G / 2, cut / (M - 1) if M > 3 else 0.0  # beyond hi: L >= cut
        # the tables' numpy work: period_cells elements per threshold and stage-count bucket; within period_work,
        # up to period_counts buckets (at most M / 4: K <= 2 x stages - 1 nears M only past M / 2 stages) and
        # period_thresholds thresholds, fewer buckets first
        tune = tuning.TUNING
        pairs = tune.period_work // max(1, period_cells(self.cm, M, self.G, cut, self.overlap))
        C = max(1, min(tune.period_counts, M // 4, pairs // 24)) if buckets else 1
        K = min(tune.period_thresholds, pairs // C)
        if hi > lo and K >= 4 and M >= tune.period_min_m:
            self.pv = period_bound(self.cm, M, self.G, lo, hi, K, cut, self.overlap, C)
            self.counts = C
            # the new stage's share of min(F, B) in its U (bounds.stage_u) per bucket of the rest after it
            self.new_share = [stage_u(M, c + 2 if c < C - 1 else None) for c in range(C)]
        self.root_bound = max(self.root_bound, self.Q[0][self.G], self.Qar[0][self.G],
                              self.period_rest(0, self.G, [0.0] * self.counts) if self.pv is not None else 0.0)

    def below(self, pre: Prefix, chain1: float | None, bb: float, ar: float, e: float) -> float:
        """refined_chains' `below` after a new stage (B ``bb``, AllReduce ``ar``, overlapped ending ``e``) that
        follows ``pre`` over a transfer whose gradients take ``chain1`` back (None: no stage before)."""
        own = e if self.overlap else bb + ar
        below = pre.below
        if below is None or chain1 is None:
            return own
        below += chain1
        return below + bb if below + bb > own else own

    def quick_floor(self, f: float, bb: float, busy2: float, chain2: float, W1: float, Bsum1: float,
                    rest: tuple) -> float:
        """A cheap lower bound on L of prefix + a new stage (F ``f``, B ``bb``; the prefix's first micro-batch
        leaves after ``W1``, its last gradient ``Bsum1`` before the end) + the rest as one stage: formula 2, M (F+B)
        of a stage; refined, the rest's chain without its waits (:meth:`rest_chain` is the full one)."""
        M = self.M
        t_f, t_b, t_ar, t_e, _ = rest
        if not self.refined:
            return max(M * (t_f + t_b), M * (f + bb), 2 * M * busy2)
        return W1 + f + busy2 + M * (t_f + t_b) + max(t_e - t_b if self.overlap else t_ar, Bsum1 + bb + chain2)

    def rest_chain(self, pre: Prefix, chain1: float | None, f: float, bb: float, ar: float, busy1: float,
                   busy2: float, chain2: float, W1: float, rest: tuple, e: float, link_period: float) -> float:
        """A lower bound on L of prefix + new stage + the rest as one stage: the rest's chain in refined_chains
        (a last stage has K = 1: warm + F + max((M-1)(F+B), arrive) + B + tail), with the arrival period (of the
        new stage and the rest) and the slowest supply taken from what is known without the window terms, the
        new stage's K at most 3 (A: 2, B: 3), and each stage's ``lead`` at its least; or any other stage's
        chain, at least the round trip without AllReduces + its least M - 1 backwards and M - K forwards
        (:func:`prefix_lead`). Nearly every plan's pivot is its last stage (the search rejects most plans here
        without evaluating them)."""
        M = self.M
        t_f, t_b, t_ar, t_e, _ = rest
        below = self.below(pre, chain1, bb, ar, e) + chain2
        own = t_e if self.overlap else t_b + t_ar
        tail = below if below > own - t_b else own - t_b
        supply = max(pre.fmax, busy1, f, busy2, t_f)
        pace = max(f + bb, t_f + t_b, link_period)
        up = 3 if M > 3 else M
        arrive = min(min(M - 1, up - 1) * supply + (M - up) * pace, (M - 1) * pace)
        lead, own = pre.lead if pre.lead is not None else prefix_lead(pre, M)
        k = 3 if M > 3 else M  # the new stage's K at most
        arrive = max(arrive, lead, (M - 1) * f + (M - k) * bb)
        steady = max((M - 1) * (t_f + t_b), arrive + t_f - t_f)  # in refined_chains' order of operations
        trip = W1 + f + busy2 + t_f + t_b
        bsum = pre.Bsum + (chain1 if chain1 is not None else 0.0) + bb + chain2 + t_b
        return max(trip + steady + tail, trip - t_b + bsum + max(own, (M - 1) * bb + (M - k) * f))

    def period_floor(self, u: float, links: float) -> float:
        """t for :meth:`period_rest` after stages whose largest U is ``u`` and whose links take at least
        ``links`` ms per micro-batch: the last stage's forwards come one per link period P >= links after its
        upstream stage's K <= 3 warmup forwards, so L >= the round trip + (M - 3) links = (M - 1) t."""
        M = self.M
        x = links * (M - 3) / (M - 1) if M > 3 else 0.0
        return u if u > x else x

    def period_ts(self, pre: Prefix, after: int, most: int, links: float) -> list:
        """period_rest's t per stage-count bucket of the rest (c + 1 stages; the last, at least ``counts``), after
        ``pre`` and ``after`` more stages: :meth:`period_floor` of :func:`prefix_u_table` with that many stages
        after the prefix (the last bucket: ``most``, as many as the rest can have)."""
        C = self.counts
        us = prefix_u_table(pre, self.M)
        last = len(us) - 1
        x = self.period_floor(0.0, links)
        cache = pre.ts if pre.ts is not None else {}
        pre.ts = cache
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

    def period_rest(self, j: int, R: int, ts: list, hi: float = 0.0, lo: float = 0.0, add: float = 0.0,
                    stop: float = -INF) -> float:
        """L - (one micro-batch's round trip so far) >= this for any split of [j, N) on R devices into c + 1
        stages (the last bucket: at least ``counts``), after stages whose largest U is ts[c] (bounds.period_bound;
        :meth:`period_ts` gives ts) and a new stage of max(F, B) ``hi`` and min(F, B) ``lo`` (its U in bucket c
        is hi + new_share[c] lo): the least over the buckets some split falls in. Or, once ``add`` + a bucket's
        value is below ``stop``, that value (a caller who only asks whether ``add`` + this reaches ``stop`` gets
        the same answer sooner)."""
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

    def with_period(self, low: float, j2: int, n_rest: int, ts: list, f: float, bb: float, W: float,
                    Bsum: float) -> float:
        """``low`` raised to the period bound of a new stage [j, j2) (F ``f``, B ``bb``) after ``W`` and ``Bsum``
        and before the rest [j2, N) on ``n_rest`` devices (period_rest, ``ts`` from period_ts)."""
        hi, lo = (f, bb) if f > bb else (bb, f)
        before = W + Bsum + f + bb
        x = before + self.period_rest(j2, n_rest, ts, hi, lo, before, nextafter(low, INF))  # (at most low: low)
        return x if x > low else low
