"""What the search prices with: per-stage costs (memoised over the stage's end) and formula 5's L of a plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ...core.schedule import warmup_counts
from ..model.cost import ServerLayout
from ..model.evaluate import pipeline_costs
from ..model.memory import NoFitError, slices_that_fit
from ..model.pivot import paper_latency
from ..model.refined import refined_chains
from .records import INF, Incumbent, PlanCosts, Prefix, SearchConfig, StageLists, Tail

if TYPE_CHECKING:
    from ..model.cost import CostModel


class StageCosts:
    """What the search prices stages and plans with, for one cost model (micro-batch size) and M micro-batches."""

    def __init__(self, cm: "CostModel", config: SearchConfig, M: int, incumbent: Incumbent):
        self.cm, self.M, self.N, self.b = cm, M, cm.num_layers, cm.micro
        self.mem = cm.cluster.device_memory
        self.refined, self.overlap, self.policy = config.refined, config.overlap, config.warmup_policy
        self.incumbent = incumbent  # its bar ends the stage lists (stage_costs)
        self._stage_costs: dict = {}  # (j, m, spans servers) -> StageLists
        self._tails: dict = {}  # rest layout -> [tail(a, layout) for a in 0..N] (filled on use)

    def latency(self, F: list, B: list, AR: list, E: list, C: list | None, D: list, *, link_period: float,
                limit: float = INF, window: list | None = None, drain: float | None = None,
                queue: Sequence | None = None, feed: list | None = None) -> tuple[float, str]:
        """The plan's L under the search's model and the better warmup policy; any value >= ``limit`` when L is
        (interleaved F, B, AR, E, chain ``C`` and D per stage; the rest as refined_chains takes them)."""
        M = self.M
        if not self.refined:
            return paper_latency(F, B, AR, M).total, self.policy or "A"
        pols: tuple[str, ...] = (self.policy,) if self.policy else ("A", "B")
        Ks = [warmup_counts(len(D), M, pol, max_in_flight=D) for pol in pols]
        if len(Ks) == 2 and Ks[0] == Ks[1]:
            Ks.pop()
        # the second policy matters only if it is faster: its chains stop once one reaches the first's L
        lats = refined_chains(F, B, AR, E if self.overlap else None, Ks, M, link_period=link_period, chain=C,
                              limit=limit, window=window, drain_period=drain, queue=queue, race=True, feed=feed)
        if len(lats) == 2 and lats[1][0] < lats[0][0] - 1e-9:
            return lats[1][0], pols[1]
        return lats[0][0], pols[0]

    def plan_latency(self, costs: PlanCosts, limit: float = INF) -> tuple[float, str]:
        """Formula 5: L (and the better warmup policy) of a prefix + its new stage (``costs``' interleaved lists)
        completed by the transfer into the rest and the rest as one stage on the free devices (its completion).
        The one function the search prices formula 5 with."""
        F, B, AR, E, C, D, Cw, completion = costs
        if completion is None:
            raise ValueError("plan_latency: the costs hold no completion (the DP's root prices no plan)")
        busy, t_f, t_b, t_ar, t_e, chain, window, t_d, period, drain, queue, feed = completion
        return self.latency(F + [busy, t_f], B + [busy, t_b], AR + [0.0, t_ar], E + [busy, t_e], C + [chain, t_b],
                            D + [t_d], link_period=period, limit=limit, window=Cw + [window, t_b], drain=drain,
                            queue=queue, feed=feed)

    def prefix_latency(self, pre: Prefix) -> float:
        """Formula 5's L of a memoised prefix (priced on first use: only ties on the floor need it)."""
        if pre.latency is None:
            pre.latency = self.plan_latency(pre.costs)[0]
        return pre.latency

    def evaluate_spans(self, spans: Sequence[tuple[int, int, ServerLayout]], *,
                       check: bool = True) -> tuple[float, str] | None:
        """(L, warmup policy) of complete stages with the same model as the search (None if a stage does not fit in
        memory; ``check`` False: priced anyway, K_i at least 1) or has more replicas than micro-batch rows)."""
        if any(len(lay) > self.b for _, _, lay in spans):
            return None
        try:
            pc, D = pipeline_costs(self.cm, spans, self.M, "A", check=check, endings=self.overlap)
        except NoFitError:
            return None
        return self.latency(pc.F, pc.B, pc.AR, pc.E, pc.chain, D, link_period=pc.link_period, window=pc.window,
                            drain=pc.drain_period, queue=pc.queue, feed=pc.feed)

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
            f, b = cm.compute(a, self.N, len(lay))
            d = cm.fits(a, self.N, len(lay))
            e = cm.overlapped_ending(a, self.N, lay) if self.overlap else b
            hit = row[a] = Tail(f, b, cm.allreduce(a, self.N, lay), e, d)
        return hit

    def stage_costs(self, j: int, m: int, multi: bool) -> StageLists:
        """A stage [j, j2) on m replicas (spanning servers or not) per end j2 (memoised: the search asks the same
        stage many times). The lists stop at the first j2 with M (F+B) >= the bar when first asked: the bar only
        falls, and no later question reaches past it (Pruner.ends breaks there)."""
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
        end, bar = j + 1, self.incumbent.bar
        while end <= N and M * ((fpre[end] - f0 + cf) + (bpre[end] - b0 + cb)) < bar:
            end += 1
        pad = [0.0] * (j + 1)
        fs = pad + [fpre[c] - f0 + cf for c in range(j + 1, end)]
        bs = pad + [bpre[c] - b0 + cb for c in range(j + 1, end)]
        ars = pad + cm.allreduce_ends(j, end, m, multi)
        if cm.recompute:  # a recomputing stage's backward runs (some of) its forward too; it holds less per slice
            rows = cm.rows(m)
            bs = pad + [cm.compute_rows(j, c, rows, cm.recompute)[1] for c in range(j + 1, end)]
            return StageLists(fs, bs, ars, [0] * (j + 1) + [cm.fits(j, c, m) for c in range(j + 1, end)])
        static = cm.static_bytes
        ds = [0] * (j + 1) + [slices_that_fit(static(j, c, m), spre[c] - s0, mem) for c in range(j + 1, end)]
        return StageLists(fs, bs, ars, ds)
