"""The planner's search (paper IV-C, formulas 4-5): DP over stage splits, replication and placement."""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from ..model.cost import CostModel
from .bounds import least_work
from .memo import SearchResult, _gc_paused, _Memo, _Prefix
from .pruning import BUCKETS_AFTER, INF, TIGHTEN_AFTER, _Pruning
from .seeds import _Seeding
from .stage_costs import _StageCosts
from .transitions import _Transitions

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile


# memoised pairs of stage layouts (CostModel.comm_pair) above which the search drops them and its placements (both
# are recomputed on use): 8 x 8 needs ~7k, 128 x 8 makes ~1k a second, each a few kB
COMM_CACHE_LIMIT = 30_000


class _DP(_Transitions, _Pruning, _StageCosts, _Memo, _Seeding):
    """Formulas 4-5 for one micro-batch size (see :func:`dp_search`)."""

    def __init__(self, profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int,
                 model: str, overlap: bool, warmup_policy: str | None, optimizer_factor: float, beam: int,
                 incumbent: float, max_stages: int | None = None, partial_kinds: int | None = None,
                 gap: float = 0.0):
        self.N, self.G, self.b = profile.num_layers, cluster.num_devices, micro_batch_size
        self.M = global_batch_size // micro_batch_size
        self.dps, self.ns = cluster.devices_per_server, cluster.servers
        self.cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor)
        self.mem = cluster.device_memory
        self.model, self.overlap, self.policy, self.beam = model, overlap, warmup_policy, beam
        self.refined = model == "refined"
        self.max_stages = max_stages
        # search="compact": at most this many kinds (free devices, replicas of the new stage) of partly used server
        # after each stage (None: any)
        self.partial_kinds = partial_kinds
        self.gap = gap
        self.set_best(incumbent, None)
        self.states = self.transitions = 0
        self._seeds: list = []  # (L, spans) of the best seed plans, for refine_seeds
        self._priced = 0  # seed plans seed() priced (the rest were past its bound)
        self.pv = None  # the period bound's tables (bounds.period_bound), made by tighten()
        self.deadline: float | None = None  # time.perf_counter() value at which run() stops (anytime search)
        self.complete = True
        self._options: dict = {}  # (free, previous layout, m) -> _Memo.options
        self._placements: dict = {}  # (free, the previous layout's servers in order, m) -> _Memo._placed
        self._kid: dict = {}  # state key -> int id (states[j] is keyed by the id)
        self._canon: dict = {}  # (free devices, new stage's layout) -> (state key id, server relabelling)
        self._stage_costs: dict = {}  # (j, m, spans servers) -> stage_costs
        self._tails: dict = {}  # rest layout -> [tail(a, layout) for a in 0..N] (filled on use)
        self.rho = least_work(self.cm, min(self.b, self.G))
        self.fill = 1.0 if self.refined else 0.0
        # refined: a stage's chain ends with the longer of the way down and its AllReduce; overlapped, the AllReduce
        # ends E >= AR after its last backward starts (CostModel.overlapped_ending), so at least AR - B after it ends
        self.ar_less = 1.0 if overlap else 0.0  # x B: what of a stage's AllReduce its last backward may hide
        self.root_bound = 0.0  # bound_tables() sets it

    # ---- helpers -------------------------------------------------------------------------------
    def record(self, latency: float, spans: tuple, policies: tuple, pol: str) -> None:
        if latency < self.best[0]:
            self.set_best(latency, (spans, policies, pol))

    def set_best(self, latency: float, found) -> None:
        """The incumbent: prune what cannot beat it by more than ``gap`` (relative)."""
        self.best = (latency, found)
        self.cut = latency / (1.0 + self.gap)

    # ---- the DP ----------------------------------------------------------------------------------------
    def run(self) -> None:
        with _gc_paused():
            self._run()

    def bound_tables(self) -> None:
        """The rest bounds' tables (_rest_tables) for plans below the cut as it is now (the seeds' or an earlier
        search's: built once, not again by tighten() unless the cut falls) and the root bound."""
        self._rest_tables(self.cut)
        # no plan below the cut has L below this (after tighten(): below the cut then)
        self.root_bound = max(self.root_bound, self.Q[0][self.G], self.Qar[0][self.G])

    def _run(self) -> None:
        if self.root_bound and self.deadline is not None and time.perf_counter() > self.deadline:
            self.complete = False  # bound before (plan()'s late sizes) and out of time: the tables would only
            return  # raise the root bound a little, for its cut is now lower
        self.bound_tables()
        N, M, b, ns, dps, cm, rho = self.N, self.M, self.b, self.ns, self.dps, self.cm, self.rho
        states: list[dict] = [dict() for _ in range(N + 1)]
        all_free = tuple([dps] * ns)
        lay0 = tuple(s for s in range(ns) for _ in range(dps))
        if self.G <= b:  # j = 0: pure data parallelism, the whole model as one stage on every device
            f, bb, ar, e, d = self.tail(0, lay0)
            if d >= 1:
                lat, pol = self.latency([f], [bb], [ar], [e], [bb], [d], 0.0)
                self.record(lat, ((0, N, lay0),), ("fresh",), pol)
        root = _Prefix(None, None, None, None, 0, (), [], [], [], [], [], [], 0.0, all_free, INF, {}, 0.0, 0.0, 0.0,
                       Cw=[])
        tighten_at, buckets_at = self.states + TIGHTEN_AFTER, self.states + BUCKETS_AFTER
        deadline = self.deadline
        for j in range(N):
            for pre in ([root] if j == 0 else self.frontier(states[j])):
                self.states += 1
                if self.states == tighten_at and self.root_bound < self.cut:
                    self.tighten()  # a search this large pays for the tighter bounds' tables
                elif self.states == buckets_at and self.root_bound < self.cut:
                    self.tighten(buckets=True)  # and this large, for their stage-count buckets
                if deadline is not None and time.perf_counter() > deadline:
                    self.complete = False
                    return
                if cm.cached_pairs() > COMM_CACHE_LIMIT:  # memoised placements and transfer tables: start afresh
                    self._options.clear()
                    self._placements.clear()
                    cm.forget_comm()
                free = pre.free
                R = sum(free)
                if R < 2 or max(pre.lb, M * (rho[N] - rho[j]) / R) >= self.cut:
                    continue
                if pre.W + max(pre.Bsum + self.Q[j][R], self.Qar[j][R]) >= self.cut:
                    continue
                links = max(pre.server_max, pre.dev)
                if self.pv is not None and pre.W + pre.Bsum + self.period_rest(
                        j, R, self.period_ts(pre, 0, min(R, N - j), links), add=pre.W + pre.Bsum,
                        stop=self.cut) >= self.cut:
                    continue
                if self.max_stages is not None and pre.depth + 2 > self.max_stages:
                    continue
                prev = pre.last
                bound = self.cut
                W0, Bsum0 = (pre.W, pre.Bsum) if self.refined else (0.0, 0.0)  # formula 2: no fill/drain bound
                most = max(free)
                for m in range(1, min(R - 1, b) + 1):
                    if deadline is not None and time.perf_counter() > deadline:
                        self.complete = False  # within a state too: one takes up to a second on 128 x 8
                        return
                    # the new stage [j, j2) must be fast enough: M (F+B) < bound; the rest must fit on R-m
                    # devices: M rho(j2, N) / (R-m) < bound and Q[j2][R-m] < bound. Skip m when no j2 does.
                    lo = bisect.bisect_right(rho, rho[N] - bound * (R - m) / M, j + 1)
                    lo = max(lo, bisect.bisect_right(self.Qcol[R - m], pre.W + pre.Bsum - bound, j + 1),
                             bisect.bisect_right(self.Qarcol[R - m], pre.W - bound, j + 1))
                    if lo >= N or M * sum(cm.compute(j, lo, m)) >= bound:
                        continue
                    # reach() without the incoming transfer, shared by this m's placements (>= 0): most m end here,
                    # before their placements are listed (the ends of a stage within one server or across servers)
                    kinds = ([False] if m <= most else []) + ([True] if m > 1 and ns > 1 else [])
                    placed = self._options.get((free, prev, m))  # listed before: only the kinds they have
                    if placed is not None:  # (an option's [8]: whether it spans servers, _Memo.options)
                        kinds = [multi for multi in kinds if any(option[8] == multi for option in placed)]
                    ts = self.period_ts(pre, 1, min(R - m, N - j - 1), links) if self.pv is not None else None
                    gate = {multi: self.reach(pre, j, m, multi, R - m, lo, pre.lb, W0, Bsum0, ts, prev is not None)
                            for multi in kinds}
                    if not any(gate.values()):
                        continue
                    for option in (placed if placed is not None else self.options(free, prev, m)):
                        self.expand(states, pre, j, m, option, prev, lo, gate)

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
    clusters: see tests/planner/test_search.py). Best means the lowest floor, the least L any completion can
    have by the bounds below, then formula 5's L (the prefix + the rest as one stage): the paper ranks by
    formula 5 alone, but with many layers left the rest-as-one-stage dominates it and prefixes differing by
    0.002% in it differed by 4% in their own stages' bound on 8x8 (RESULTS.md "Planning time": plans up to 19%
    faster). Replica order inside a stage: two candidates (aligned with the previous stage; fullest remaining
    servers first).

    Pruning never drops a plan that could beat the best complete plan so far (``incumbent``, the ``seed`` plans
    with their cuts refined by local search, and every complete plan the DP meets): L >= M (F_s+B_s) for every
    stage under both models, and under the refined model L >= (first micro-batch's way to a stage) + M (F+B) +
    (last gradient's way back), the remaining layers' least work over the free devices, one micro-batch's round
    trip, and that round trip + (M - 1) max(F_s, B_s) + (M - K_s) min(F_s, B_s) for every stage s
    (bounds.period_bound, per count of the rest's stages).
    ``partial_kinds``: only placements after which the partly used servers come in at most this many kinds
    (free devices, replicas of the new stage): the compact search of :func:`dapple.plan` (1). ``time_limit``:
    stop after that many seconds with the best plan so far (SearchResult via the seeds). ``gap``: prune what
    cannot beat the best plan so far by more than this fraction (the result is within 1 + gap of the search's
    without it). Returns None when nothing beats ``incumbent``.
    """
    if global_batch_size % micro_batch_size or not can_occupy(cluster.num_devices, profile.num_layers,
                                                              micro_batch_size, max_stages):
        return None  # no plan of this micro-batch size: decided before the DP's tables are built
    dp = _DP(profile, cluster, global_batch_size, micro_batch_size, model, overlap, warmup_policy,
             optimizer_factor, beam, incumbent, max_stages, partial_kinds, gap)
    if seed:
        dp.seed()
        dp.refine_seeds()
    if time_limit is not None:
        dp.deadline = time.perf_counter() + time_limit
    dp.run()
    if dp.best[1] is None:
        return None
    spans, policies, pol = dp.best[1]
    return SearchResult(dp.best[0], spans, policies, pol, micro_batch_size, dp.states, dp.transitions)
