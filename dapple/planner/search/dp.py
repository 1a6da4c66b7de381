"""The fast DP of formulas 4-5 for one micro-batch size: reference.py's recurrence with bounds, memo and seeds."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import tuning
from ..model.cost import CostModel
from .bounds import Pruner, least_work
from .exact import exact_search
from .memo import Memo, gc_paused
from .pricing import StageCosts
from .records import (
    INF,
    Best,
    Found,
    Incumbent,
    Prefix,
    Progress,
    SearchConfig,
    SearchResult,
    Start,
)
from .seeds import Seeder
from .transitions import Expander

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

__all__ = ["DPSearch", "INF", "SearchConfig", "SearchResult", "can_occupy", "dp_search", "most_stages"]


class DPSearch:
    """Formulas 4-5 for one micro-batch size (see :func:`dp_search`; reference.py is the same recurrence without
    what makes it fast): the incumbent, the stage costs, the bounds, the memo, the seeds and the transitions it is
    built from, and the DP over them.

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
                            recompute=config.recompute, mixed_precision=config.mixed_precision,
                            shard_optimizer=config.shard_optimizer)
        self.rho = least_work(self.cm, min(self.b, self.G))
        self.incumbent = Incumbent(incumbent, config.gap)
        self.costs = StageCosts(self.cm, config, self.M, self.incumbent)
        self.pruner = Pruner(self.costs, self.G, self.rho)
        self.memo = Memo(self.ns, self.dps, self.b, config.partial_kinds)
        self.seeder = Seeder(self.costs, self.rho, self.G, self.dps, config.max_stages, self.incumbent)
        self.expander = Expander(self.costs, self.pruner, config, self.ns)
        self.states = 0  # DP states expanded
        self.complete = True  # whether run() finished (not stopped by the deadline)
        self.certified = False  # whether certify() proved that no plan of this size is below its incumbent
        self.deadline: float | None = None

    # ---- what the search has found -----------------------------------------------------------------------
    @property
    def best(self) -> Best:
        return self.incumbent.best

    @property
    def bar(self) -> float:
        """What a plan must stay below to matter (the incumbent's latency / (1 + gap))."""
        return self.incumbent.bar

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
        """The rest bounds' tables for plans below the bar as it is now, and the root bound (Pruner.bound_tables)."""
        self.pruner.bound_tables()
        return self.progress()

    def run(self) -> Progress:
        """The DP (anytime: it stops at ``deadline`` with the best plan so far, ``complete`` False)."""
        with gc_paused():
            self._run()
        return self.progress()

    def certify(self, bar: float) -> bool:
        """Every plan of this size below ``bar`` (any split, replicas in any order on any servers) enumerated where
        the instance is small enough (exact.exact_search): one that beats the incumbent becomes it. Returns whether
        it ran; then no plan of this size is modelled below min(bar, the incumbent) (``certified``)."""
        if self.pruner.root_bound >= bar > 0:
            self.certified = True  # the bounds alone: no plan below the bar (the bar the tables were made for is not
            return True  # below it)
        ex = exact_search(self.cm, self.M, self.config, bar, deadline=self.deadline)
        if ex is None:
            return False
        if ex.latency < self.incumbent.latency:
            self.set_best(*ex)
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
        states: list[dict] = [dict() for _ in range(self.N + 1)]  # per layer j: state key -> its prefixes
        self.expander.states = states
        self._one_stage()
        root = Prefix(free=tuple([self.dps] * self.ns), latency=INF)
        tune = tuning.TUNING
        tighten_at, buckets_at = self.states + tune.tighten_after, self.states + tune.buckets_after
        pruner, incumbent, cm, cache_limit = self.pruner, self.incumbent, self.cm, tune.comm_cache_limit
        for j in range(self.N):
            for pre in ([root] if j == 0 else Memo.frontier(states[j])):
                self.states += 1
                if self.states == tighten_at and pruner.root_bound < incumbent.bar:
                    pruner.tighten()  # a search this large pays for the tighter bounds' tables
                elif self.states == buckets_at and pruner.root_bound < incumbent.bar:
                    pruner.tighten(buckets=True)  # and this large, for their stage-count buckets
                if self._late():
                    return
                if cm.cached_pairs() > cache_limit:  # memoised placements and transfer tables: start afresh
                    self.memo.forget()
                    cm.forget_comm()
                if not self._pruned(pre, j) and not self._expand_state(pre, j):
                    return  # out of time

    def _one_stage(self) -> None:
        """j = 0 as the whole plan: pure data parallelism, the whole model as one stage on every device."""
        if self.G > self.b:
            return
        lay0 = tuple(s for s in range(self.ns) for _ in range(self.dps))
        f, b, ar, e, d = self.costs.tail(0, lay0)
        if d >= 1:
            lat, pol = self.costs.latency([f], [b], [ar], [e], [b], [d], link_period=0.0)
            self.incumbent.offer(lat, ((0, self.N, lay0),), ("fresh",), pol)

    def _pruned(self, pre: Prefix, j: int) -> bool:
        """Whether no completion of ``pre`` (layers [0, j) planned) can beat the bar: fewer than 2 devices left, the
        bounds (Pruner.prunes), or one more stage than ``max_stages`` allows."""
        R = sum(pre.free)
        if R < 2 or self.pruner.prunes(pre, j, R):
            return True
        return self.config.max_stages is not None and pre.depth + 2 > self.config.max_stages

    def _expand_state(self, pre: Prefix, j: int) -> bool:
        """Every new stage [j, j2) on m replicas after ``pre`` whose ends pass the bounds (False: out of time)."""
        N, pruner, memo, expander, costs = self.N, self.pruner, self.memo, self.expander, self.costs
        deadline = self.deadline
        free, prev = pre.free, pre.last
        R, most, links = sum(free), max(free), max(pre.links.server_max, pre.links.dev)
        bar = self.incumbent.bar  # (the bar when the state is reached: its ends below are read against it)
        period = pruner.has_period_bound  # (only tighten() changes it, between states)
        # formula 2 has no fill/drain bound: its stages start at 0
        start = Start(pre.lb, pre.forward_sum, pre.backward_sum) if self.refined else Start(pre.lb, 0.0, 0.0)
        for m in range(1, min(R - 1, self.b) + 1):
            if deadline is not None and time.perf_counter() > deadline:
                self.complete = False  # within a state too: one can take long on many servers
                return False
            lo = pruner.first_end(pre, j, m, R - m, bar)
            if lo is None:
                continue
            # the ends from lo that pass the bounds before the transfer into the stage is priced, per whether it
            # spans servers, shared by this m's placements: most m end here, before their placements are listed
            kinds = ([False] if m <= most else []) + ([True] if m > 1 and self.ns > 1 else [])
            placed = memo.known(free, prev, m)  # listed before: only the kinds its placements have
            if placed is not None:
                kinds = [multi for multi in kinds if any(option.multi == multi for option in placed)]
            ts = pruner.period_ts(pre, 1, min(R - m, N - j - 1), links) if period else None
            gate = {multi: pruner.ends(costs.stage_costs(j, m, multi), R - m, start, lo, ts, prev is not None)
                    for multi in kinds}
            if not any(gate.values()):
                continue
            for option in (placed if placed is not None else memo.options(free, prev, m)):
                expander.expand(pre, j, option, gate)
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
    """Formulas 4-5 for one micro-batch size (reference.py states them; docs/planner.md, "Inside the search", says
    how this DP keys, ranks and prunes): the best plan it meets, each state keeping the ``beam`` prefixes with the
    lowest floor, since with many layers left formula 5's rest-as-one-stage dominates formula 5 itself.

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
