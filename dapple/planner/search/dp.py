"""The planner's search (paper IV-C, formulas 4-5): DP over stage splits, replication and placement."""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from .. import tuning
from ..model.cost import CostModel
from .bounds import least_work
from .exact import exact_search
from .memo import Memo, gc_paused
from .pruning import Pruner
from .records import INF, Best, Found, Incumbent, Prefix, Progress, SearchConfig, SearchResult
from .seeds import Seeder
from .stage_costs import StageCosts
from .transitions import Expander

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

__all__ = ["DPSearch", "INF", "SearchConfig", "SearchResult", "can_occupy", "dp_search", "most_stages"]


class DPSearch:
    """Formulas 4-5 for one micro-batch size (see :func:`dp_search`): the incumbent, the stage costs, the bounds,
    the memo, the seeds and the transitions it is built from, and the DP over them.

    Its steps, each returning its :class:`Progress` (what a forked worker sends back, :meth:`adopt`): :meth:`seed`,
    :meth:`refine_seeds`, :meth:`bound_tables`, :meth:`run`. ``deadline``: a time.perf_counter() value at which
    run() stops with the best plan so far (None: none)."""

    def __init__(self, profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int,
                 config: SearchConfig, incumbent: float = INF):
        self.config, self.refined = config, config.refined
        self.N, self.G, self.b = profile.num_layers, cluster.num_devices, micro_batch_size
        self.M = global_batch_size // micro_batch_size
        self.dps, self.ns = cluster.devices_per_server, cluster.servers
        self.cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=config.optimizer_factor,
                            recompute=config.recompute, mixed_precision=config.mixed_precision)
        self.rho = least_work(self.cm, min(self.b, self.G))
        self.incumbent = Incumbent(incumbent, config.gap)
        self.costs = StageCosts(self.cm, config, self.M, self.incumbent)
        self.pruner = Pruner(self.cm, config, self.M, self.G, self.rho, self.incumbent)
        self.memo = Memo(self.ns, self.dps, self.b, config.partial_kinds)
        self.seeder = Seeder(self.costs, self.rho, self.G, self.dps, config.max_stages, self.incumbent)
        self.expander = Expander(self.cm, config, self.M, self.ns, self.costs, self.pruner, self.incumbent)
        self.states = 0  # DP states expanded
        self.complete = True  # whether run() finished (not stopped by the deadline)
        self.certified = False  # whether certify() proved that no plan of this size is below its incumbent
        self.deadline: float | None = None

    # ---- what the search has found -----------------------------------------------------------------------
    @property
    def best(self) -> Best:
        return self.incumbent.best

    @property
    def cut(self) -> float:
        return self.incumbent.cut

    def set_best(self, latency: float, found: Found | None) -> None:
        """The incumbent: prune what cannot beat it by more than ``gap`` (relative)."""
        self.incumbent.set(latency, found)

    @property
    def transitions(self) -> int:
        return self.expander.count

    @property
    def root_bound(self) -> float:
        return self.pruner.root_bound

    def result(self) -> SearchResult | None:
        """The best plan found (None: nothing beats the incumbent it was given)."""
        found = self.incumbent.found
        if found is None:
            return None
        return SearchResult(self.incumbent.latency, found.spans, found.policies, found.warmup_policy, self.b,
                            self.states, self.transitions)

    # ---- its steps ---------------------------------------------------------------------------------------
    def seed(self) -> Progress:
        """The even-split seed plans (Seeder.seed): the best is the incumbent."""
        self.seeder.seed()
        return self.progress()

    def refine_seeds(self) -> Progress:
        """Local search over the cuts of the best seeds (Seeder.refine_seeds)."""
        self.seeder.refine_seeds()
        return self.progress()

    def bound_tables(self) -> Progress:
        """The rest bounds' tables for plans below the cut as it is now, and the root bound (Pruner.bound_tables)."""
        self.pruner.bound_tables()
        return self.progress()

    def run(self) -> Progress:
        """The DP (anytime: it stops at ``deadline`` with the best plan so far, ``complete`` False)."""
        with gc_paused():
            self._run()
        return self.progress()

    def certify(self, cut: float) -> bool:
        """Every plan of this size below ``cut`` (any split, replicas in any order on any servers) enumerated where
        the instance is small enough (exact.exact_search): one that beats the incumbent becomes it. Returns whether
        it ran; then no plan of this size is modelled below min(cut, the incumbent) (``certified``)."""
        if self.pruner.root_bound >= cut > 0:
            self.certified = True  # the bounds alone: no plan below the cut (the cut the tables were made for is not
            return True  # below it)
        ex = exact_search(self.cm, self.M, self.config, cut, deadline=self.deadline)
        if ex is None:
            return False
        if ex.latency < self.incumbent.latency:
            self.set_best(ex.latency, Found(ex.spans, ("enumerated",) * len(ex.spans), ex.warmup_policy))
        self.certified = True
        return True

    def progress(self) -> Progress:
        """What the steps so far have made of this search."""
        return Progress(self.best, tuple(self.seeder.kept), self.seeder.priced, self.pruner.root_bound, self.states,
                        self.transitions, self.complete)

    def adopt(self, progress: Progress) -> None:
        """Stand as the search whose :meth:`progress` a forked worker sent back (its tables stay in the worker)."""
        self.set_best(*progress.best)
        self.seeder.kept, self.seeder.priced = list(progress.seeds), progress.priced
        self.pruner.root_bound, self.states, self.expander.count = progress.root_bound, progress.states, \
            progress.transitions
        self.complete = progress.complete

    # ---- the DP ------------------------------------------------------------------------------------------
    def _late(self) -> bool:
        """Whether the deadline has passed (then the search is not complete)."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.complete = False
            return True
        return False

    def _run(self) -> None:
        if self.pruner.root_bound and self._late():
            return  # bound before (plan()'s late sizes) and out of time: the tables would only raise the root bound
        self.pruner.bound_tables()
        states: list[dict] = [dict() for _ in range(self.N + 1)]
        self._one_stage()
        root = Prefix(free=tuple([self.dps] * self.ns), latency=INF)
        tune = tuning.TUNING
        tighten_at, buckets_at = self.states + tune.tighten_after, self.states + tune.buckets_after
        pruner, incumbent, cm, cache_limit = self.pruner, self.incumbent, self.cm, tune.comm_cache_limit
        for j in range(self.N):
            for pre in ([root] if j == 0 else Memo.frontier(states[j])):
                self.states += 1
                if self.states == tighten_at and pruner.root_bound < incumbent.cut:
                    pruner.tighten()  # a search this large pays for the tighter bounds' tables
                elif self.states == buckets_at and pruner.root_bound < incumbent.cut:
                    pruner.tighten(buckets=True)  # and this large, for their stage-count buckets
                if self._late():
                    return
                if cm.cached_pairs() > cache_limit:  # memoised placements and transfer tables: start afresh
                    self.memo.forget()
                    cm.forget_comm()
                if not self._pruned(pre, j) and not self._expand_state(states, pre, j):
                    return  # out of time

    def _one_stage(self) -> None:
        """j = 0 as the whole plan: pure data parallelism, the whole model as one stage on every device."""
        if self.G > self.b:
            return
        lay0 = tuple(s for s in range(self.ns) for _ in range(self.dps))
        f, bb, ar, e, d = self.costs.tail(0, lay0)
        if d >= 1:
            lat, pol = self.costs.latency([f], [bb], [ar], [e], [bb], [d], 0.0)
            self.incumbent.offer(lat, ((0, self.N, lay0),), ("fresh",), pol)

    def _pruned(self, pre: Prefix, j: int) -> bool:
        """Whether no completion of ``pre`` (layers [0, j) planned) can beat the cut: the rest's least work over
        the free devices, the rest bounds, the period bound, or one more stage than ``max_stages`` allows."""
        N, M, rho, pruner, cut = self.N, self.M, self.rho, self.pruner, self.incumbent.cut
        R = sum(pre.free)
        if R < 2 or max(pre.lb, M * (rho[N] - rho[j]) / R) >= cut:
            return True
        if pre.W + max(pre.Bsum + pruner.Q[j][R], pruner.Qar[j][R]) >= cut:
            return True
        if pruner.pv is not None and pre.W + pre.Bsum + pruner.period_rest(
                j, R, pruner.period_ts(pre, 0, min(R, N - j), max(pre.server_max, pre.dev)), add=pre.W + pre.Bsum,
                stop=cut) >= cut:
            return True
        return self.config.max_stages is not None and pre.depth + 2 > self.config.max_stages

    def _expand_state(self, states: list, pre: Prefix, j: int) -> bool:
        """Every new stage [j, j2) on m replicas after ``pre`` whose ends pass the bounds (False: out of time)."""
        N, M, rho, cm, pruner, memo, expander = self.N, self.M, self.rho, self.cm, self.pruner, self.memo, self.expander
        free, prev, deadline = pre.free, pre.last, self.deadline
        R, most, links = sum(free), max(free), max(pre.server_max, pre.dev)
        bound = self.incumbent.cut  # (the cut when the state is reached: its ends below are read against it)
        W0, Bsum0 = (pre.W, pre.Bsum) if self.refined else (0.0, 0.0)  # formula 2: no fill/drain bound
        for m in range(1, min(R - 1, self.b) + 1):
            if deadline is not None and time.perf_counter() > deadline:
                self.complete = False  # within a state too: one can take long on many servers
                return False
            # the new stage [j, j2) must be fast enough: M (F+B) < bound; the rest must fit on R-m devices:
            # M rho(j2, N) / (R-m) < bound and Q[j2][R-m] < bound. Skip m when no j2 does.
            lo = bisect.bisect_right(rho, rho[N] - bound * (R - m) / M, j + 1)
            lo = max(lo, bisect.bisect_right(pruner.Qcol[R - m], pre.W + pre.Bsum - bound, j + 1),
                     bisect.bisect_right(pruner.Qarcol[R - m], pre.W - bound, j + 1))
            if lo >= N or M * sum(cm.compute(j, lo, m)) >= bound:
                continue
            # the ends from lo that pass the bounds before the transfer into the stage is priced, per whether it
            # spans servers, shared by this m's placements: most m end here, before their placements are listed
            kinds = ([False] if m <= most else []) + ([True] if m > 1 and self.ns > 1 else [])
            placed = memo.listed.get((free, prev, m))  # listed before: only the kinds its placements have
            if placed is not None:
                kinds = [multi for multi in kinds if any(option.multi == multi for option in placed)]
            ts = pruner.period_ts(pre, 1, min(R - m, N - j - 1), links) if pruner.pv is not None else None
            gate = {multi: expander.reach(pre, j, m, multi, R - m, lo, pre.lb, W0, Bsum0, ts, prev is not None)
                    for multi in kinds}
            if not any(gate.values()):
                continue
            for option in (placed if placed is not None else memo.options(free, prev, m)):
                expander.expand(states, pre, j, m, option, prev, gate)
        return True


def most_stages(num_layers: int, max_stages: int | None) -> int:
    """How many stages a plan can have: one layer each at least, and no more than ``max_stages``."""
    return num_layers if max_stages is None else min(max_stages, num_layers)


def can_occupy(devices: int, num_layers: int, micro_batch_size: int, max_stages: int | None) -> bool:
    """Whether a plan can use every device: a stage has at most one replica per micro-batch row."""
    return devices <= most_stages(num_layers, max_stages) * micro_batch_size


def dp_search(profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int, *,
              model: str = "paper", overlap: bool = False, warmup_policy: str | None = None,
              optimizer_factor: float = 4.0, beam: int = 1, incumbent: float = INF,
              seed: bool = True, max_stages: int | None = None, partial_kinds: int | None = None,
              time_limit: float | None = None, gap: float = 0.0) -> SearchResult | None:
    """Formulas 4-5 for one micro-batch size: T_PL(j', m+m', g+g') = L of (planned stages + a new stage
    [j, j') on m' devices placed by Fresh/Append/Scatter First + the rest as one stage on the free devices).

    Memoised on (j, free devices per server, where the last stage's replicas sit), up to server symmetry:
    servers with the same descriptor are interchangeable for every later decision and cost, and the last
    stage's replica positions decide the split-concat routes to the next stage (the free counts alone do
    not). Each key keeps the ``beam`` best prefixes (the paper keeps one): exact only if a longer plan's L
    were a function of the key, which it is not, so this is where the DP is heuristic (brute force on small
    clusters: tests/planner/search/test_dp.py). Best means the lowest floor, the least L any completion can
    have by the bounds, then formula 5's L (the prefix + the rest as one stage): the paper ranks by formula 5
    alone, but with many layers left the rest-as-one-stage dominates it. Replica order inside a stage: two
    candidates (aligned with the previous stage; fullest remaining servers first).

    Pruning never drops a plan that could beat the best complete plan so far (``incumbent``, the seed plans
    with their cuts refined by local search, and every complete plan the DP meets): see pruning.Pruner.

    Args:
        profile, cluster, global_batch_size, micro_batch_size: the instance (M = global / micro micro-batches).
        model, overlap, warmup_policy, optimizer_factor, beam, max_stages, partial_kinds, gap: see SearchConfig.
        incumbent: only plans faster than this are of interest.
        seed: start from the seed plans (Seeder) as the incumbent.
        time_limit: stop after that many seconds (after the seeds) with the best plan so far.

    Returns:
        The best plan found, or None when nothing beats ``incumbent`` (or no plan of this micro-batch size
        can use every device).
    """
    if global_batch_size % micro_batch_size or not can_occupy(cluster.num_devices, profile.num_layers,
                                                              micro_batch_size, max_stages):
        return None  # no plan of this micro-batch size: decided before the DP's tables are built
    config = SearchConfig(model=model, overlap=overlap, warmup_policy=warmup_policy, optimizer_factor=optimizer_factor,
                          beam=beam, max_stages=max_stages, partial_kinds=partial_kinds, gap=gap)
    search = DPSearch(profile, cluster, global_batch_size, micro_batch_size, config, incumbent)
    if seed:
        search.seed()
        search.refine_seeds()
    if time_limit is not None:
        search.deadline = time.perf_counter() + time_limit
    search.run()
    return search.result()
