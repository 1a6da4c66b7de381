"""The search's per-stage costs (memoised over the stage's end) and L of a candidate plan under its latency model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ...core.schedule import warmup_counts
from ..model.cost import ServerLayout
from ..model.evaluate import pipeline_costs
from ..model.memory import NoFitError, slices_that_fit
from ..model.pivot import paper_latency
from ..model.refined import refined_chains
from .records import INF, Incumbent, Job, Prefix, SearchConfig, StageLists, Tail

if TYPE_CHECKING:
    from ..model.cost import CostModel


class StageCosts:
    """What the search prices stages and plans with, for one cost model (micro-batch size) and M micro-batches."""

    def __init__(self, cm: "CostModel", config: SearchConfig, M: int, incumbent: Incumbent):
        self.cm, self.M, self.N, self.b = cm, M, cm.num_layers, cm.micro
        self.mem = cm.cluster.device_memory
        self.refined, self.overlap, self.policy = config.refined, config.overlap, config.warmup_policy
        self.incumbent = incumbent  # its cut ends the stage lists (stage_costs)
        self._stage_costs: dict = {}  # (j, m, spans servers) -> StageLists
        self._tails: dict = {}  # rest layout -> [tail(a, layout) for a in 0..N] (filled on use)

    def latency(self, F, B, AR, E, C, D, link_period: float, limit: float = INF, W=None,
                drain: float | None = None, queue=None, feed=None) -> tuple[float, str]:
        """The plan's L under the search's model and the better warmup policy; any value >= ``limit`` when L is."""
        M = self.M
        if not self.refined:
            return paper_latency(F, B, AR, M).total, self.policy or "A"
        pols = (self.policy,) if self.policy else ("A", "B")
        Ks = [warmup_counts(len(D), M, pol, max_in_flight=D) for pol in pols]
        if len(Ks) == 2 and Ks[0] == Ks[1]:
            Ks.pop()
        # the second policy matters only if it is faster: its chains stop once one reaches the first's L
        lats = refined_chains(F, B, AR, E if self.overlap else None, Ks, M, link_period, C, limit, W, drain, queue,
                              race=True, feed=feed)
        if len(lats) == 2 and lats[1][0] < lats[0][0] - 1e-9:
            return lats[1][0], pols[1]
        return lats[0][0], pols[0]

    def plan_latency(self, F: list, B: list, AR: list, E: list, C: list, D: list, Cw: list, job: Job,
                     limit: float = INF) -> tuple[float, str]:
        """:meth:`latency` of prefix + new stage (their interleaved F, B, AR, E, chain, D and window) + the rest as
        one stage (``job``: the transfer into it and its own costs, the periods, queues and feeds)."""
        busy2, t_f, t_b, t_ar, t_e, chain2, window2, t_d, period, drain, queue, feed = job
        return self.latency(F + [busy2, t_f], B + [busy2, t_b], AR + [0.0, t_ar], E + [busy2, t_e],
                            C + [chain2, t_b], D + [t_d], period, limit, Cw + [window2, t_b], drain, queue, feed)

    def prefix_latency(self, pre: Prefix) -> float:
        """Formula 5's L of a memoised prefix (priced on first use: only ties on the floor need it)."""
        if pre.latency is None:
            pre.latency = self.plan_latency(pre.F, pre.B, pre.AR, pre.E, pre.C, pre.D, pre.Cw, pre.job)[0]
        return pre.latency

    def evaluate_spans(self, spans: Sequence[tuple[int, int, ServerLayout]]) -> tuple[float, str] | None:
        """Latency of complete stages with the same model as the search (None if a stage does not fit)."""
        if any(len(lay) > self.b for _, _, lay in spans):
            return None
        try:
            pc, D = pipeline_costs(self.cm, spans, self.M, "A", endings=self.overlap)
        except NoFitError:
            return None
        return self.latency(pc.F, pc.B, pc.AR, pc.E, pc.chain, D, pc.link_period, W=pc.window, drain=pc.drain_period,
                            queue=pc.queue, feed=pc.feed)

    def tails(self, lay: ServerLayout) -> list:
        """``[tail(a, lay) for a in range(N)]``, each filled on first use (the search reads it by index)."""
        hit = self._tails.get(lay)
        if hit is None:
            hit = self._tails[lay] = [None] * self.N
        return hit

    def tail(self, a: int, lay: ServerLayout) -> Tail:
        """The rest [a, N) as one stage on ``lay`` (memoised)."""
        row = self.tails(lay)
        hit = row[a]
        if hit is None:
            cm = self.cm
            f, bb = cm.compute(a, self.N, len(lay))
            d = cm.fits(a, self.N, len(lay))
            e = cm.overlapped_ending(a, self.N, lay) if self.overlap else bb
            hit = row[a] = Tail(f, bb, cm.allreduce(a, self.N, lay), e, d)
        return hit

    def stage_costs(self, j: int, m: int, multi: bool) -> StageLists:
        """A stage [j, j2) on m replicas (spanning servers or not) per end j2 (memoised: the search asks the same
        stage many times). The lists stop at the first j2 with M (F+B) >= the cut when first asked: the cut only
        falls, and no later question reaches past it (Transitions.reach breaks there)."""
        key = (j, m, multi)
        hit = self._stage_costs.get(key)
        if hit is None:
            hit = self._stage_costs[key] = self._stage_lists(j, m, multi)
        return hit

    def _stage_lists(self, j: int, m: int, multi: bool) -> StageLists:
        cm, N, mem, M = self.cm, self.N, self.mem, self.M
        fpre, bpre, spre = cm.prefix_sums(cm.rows(m))  # prefix sums over layers of the stage's slice
        f0, b0, s0 = fpre[j], bpre[j], spre[j]
        cf, cb = cm.call_f, cm.call_b  # (CostModel.compute_rows: the stage's call, once)
        end, cut = j + 1, self.incumbent.cut
        while end <= N and M * ((fpre[end] - f0 + cf) + (bpre[end] - b0 + cb)) < cut:
            end += 1
        pad = [0.0] * (j + 1)
        fs = pad + [fpre[c] - f0 + cf for c in range(j + 1, end)]
        bs = pad + [bpre[c] - b0 + cb for c in range(j + 1, end)]
        ars = pad + cm.allreduce_ends(j, end, m, multi)
        if cm.recompute:  # a recomputing stage's backward runs its forward too, and it holds its inputs per slice
            bs = pad + [b + f for b, f in zip(bs[j + 1:], fs[j + 1:])]
            return StageLists(fs, bs, ars, [0] * (j + 1) + [cm.fits(j, c, m) for c in range(j + 1, end)])
        static = cm.static_bytes
        ds = [0] * (j + 1) + [slices_that_fit(static(j, c), spre[c] - s0, mem) for c in range(j + 1, end)]
        return StageLists(fs, bs, ars, ds)


def same_costs(pre: Prefix, costs: tuple) -> bool:
    """Whether a memoised prefix and a candidate's ``costs`` (StageCosts.plan_latency's arguments but the limit)
    price the same: equal interleaved costs, periods, queues and feeds (so the same L, to the bit)."""
    return (pre.F, pre.B, pre.AR, pre.E, pre.C, pre.D, pre.Cw, pre.job) == costs
