"""The bounds the search prunes with (bounds.py's tables, the rest's own chain), as a part of ``search._DP``."""

from __future__ import annotations

import bisect

import numpy as np

from .bounds import INF, efficient_replicas, period_bound, rest_bound
from .memo import _Prefix

TIGHTEN_AFTER = 100  # states expanded before the search tightens its bounds (small searches do not need to)
PERIOD_THRESHOLDS = 32  # bounds.period_bound's thresholds: it gives up at most (M - 3) x their spacing
PERIOD_WORK = 1.5e9  # at most this many array elements for its tables (about 2 s here; 128 x 8: 11 thresholds)
PERIOD_MIN_M = 16  # fewer micro-batches: (M - 3) periods add too little to pay for the tables


class _Pruning:
    """The lower bounds of ``search._DP`` on L of a prefix's completions (it provides the costs and the cut)."""

    def _rest_tables(self, cut: float) -> None:
        """Q[j][R]: least that layers [j, N) on R devices add to L under any split (bounds.rest_bound);
        Qar[j][R]: the same with each stage's least AllReduce and only forwards before it (refined model: a
        stage's chain ends with its AllReduce; overlapped, with what of it follows the last backward); Qar is
        used after the first micro-batch's forwards W, Q after W + the backwards Bsum. Qcol[R][j] = -Q[j][R],
        increasing in j, for bisect."""
        ov = self.overlap
        q = rest_bound(self.cm, self.M, self.G, fill=self.refined, cut=cut, overlap=ov)
        self.Q = q.tolist()
        self.Qcol = (-q.T).tolist()
        qa = (rest_bound(self.cm, self.M, self.G, fill=True, allreduce=True, cut=cut, overlap=ov) if self.refined
              else np.zeros_like(q))
        self.Qar = qa.tolist()
        self.Qarcol = (-qa.T).tolist()

    def below(self, pre: _Prefix, chain1: float | None, bb: float, ar: float, e: float) -> float:
        """refined_chains' `below` after a new stage (B ``bb``, AllReduce ``ar``, overlapped ending ``e``) that
        follows ``pre`` over a transfer whose gradients take ``chain1`` back (None: no stage before)."""
        own = e if self.overlap else bb + ar
        below = pre.below
        if below is None or chain1 is None:
            return own
        below += chain1
        return below + bb if below + bb > own else own

    def rest_chain(self, pre: _Prefix, chain1: float | None, f: float, bb: float, ar: float, busy1: float,
                   busy2: float, chain2: float, W1: float, rest: tuple, e: float, link_period: float) -> float:
        """A lower bound on L of prefix + new stage + the rest as one stage: the rest's chain in refined_chains
        (a last stage has K = 1: warm + F + max((M-1)(F+B), arrive) + B + tail), with the arrival period and the
        slowest supply taken from what is known without the window terms, and the new stage's K at most 3 (A: 2,
        B: 3; arrive falls as K grows). Nearly every plan's pivot is its last stage (the search rejects most
        plans here without evaluating them)."""
        M = self.M
        t_f, t_b, t_ar, t_e, _ = rest
        below = self.below(pre, chain1, bb, ar, e) + chain2
        own = t_e if self.overlap else t_b + t_ar
        tail = below if below > own - t_b else own - t_b
        supply = max(pre.fmax, busy1, f, busy2, t_f)
        period = max(pre.tmax, f + bb, t_f + t_b, link_period)
        up = 3 if M > 3 else M
        arrive = min(min(M - 1, up - 1) * supply + (M - up) * period, (M - 1) * period)
        steady = max((M - 1) * (t_f + t_b), arrive + t_f - t_f)  # in refined_chains' order of operations
        return W1 + f + busy2 + t_f + steady + t_b + tail

    def tighten(self) -> None:
        """Once the search is large (TIGHTEN_AFTER states): the rest bounds again, now for plans below the cut
        only (bounds.rest_bound's ``cut``: no stage whose own chain reaches it), and the period bound's tables
        (bounds.period_bound). In the micro-batch-searched 8x8 case of benchmarks/planning_time.py they cut
        the DP's time from 34.9 to 9.05 s (tests/planner/test_bounds.py checks both against every small plan)."""
        if not self.refined or self.cut == INF:
            return
        self._rest_tables(self.cut)
        lo, hi = self.rho[self.N] / self.G, self.cut / (self.M - 3) if self.M > 3 else 0.0  # beyond hi: L >= cut
        # the tables' numpy work is about N^2 / 2 x (G + 1) x replica counts per threshold: fewer on large clusters
        per = self.N ** 2 // 2 * (self.G + 1) * len(efficient_replicas(self.b, self.G))
        K = min(PERIOD_THRESHOLDS, int(PERIOD_WORK // per))
        if hi > lo and K >= 4 and self.M >= PERIOD_MIN_M:
            self.pv = period_bound(self.cm, self.M, self.G, lo, hi, K, self.cut, self.overlap)
        self.root_bound = max(self.root_bound, self.Q[0][self.G], self.Qar[0][self.G],
                              self.period_rest(0, self.G, 0.0) if self.pv is not None else 0.0)

    def period_rest(self, j: int, R: int, t: float) -> float:
        """L - (one micro-batch's round trip so far) >= this for any split of [j, N) on R devices, after stages
        whose period is t (bounds.period_bound)."""
        taus, V, S = self.pv
        k = bisect.bisect_right(taus, t)
        a = V[k][j][R] + (self.M - 3) * t
        c = S[k + 1][j][R]
        return a if a < c else c
