"""The planner's search (paper IV-C, formulas 4-5): DP over stage splits, replication and placement."""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from .comm import NO_USERS, add_users, feeds, queues
from .cost import CostModel
from .memo import SearchResult, _gc_paused, _Memo, _Prefix
from .pruning import BUCKETS_AFTER, INF, TIGHTEN_AFTER, _Pruning
from .seeds import _Seeding
from .stage_costs import _StageCosts, same_costs

if TYPE_CHECKING:
    from ..profiler.profile import Profile
    from .cluster import Cluster


# memoised pairs of stage layouts (CostModel.comm_pair) above which the search drops them and its placements (both
# are recomputed on use): 8 x 8 needs ~7k, 128 x 8 makes ~1k a second, each a few kB
COMM_CACHE_LIMIT = 30_000
NO_LOAD = (0.0, 0.0)  # a server's (uplink, downlink) ms per micro-batch before any transfer crosses it


class _DP(_Pruning, _StageCosts, _Memo, _Seeding):
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
        # rho[j]: least per-micro-batch work (ms x devices) any stage split can give layers [0, j)
        rho = [0.0]
        for layer in range(self.N):
            rho.append(rho[-1] + min(r * sum(self.cm.compute(layer, layer + 1, r))
                                     for r in range(1, min(self.b, self.G) + 1)))
        self.rho = rho
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
        for j in range(N):
            for pre in ([root] if j == 0 else self.frontier(states[j])):
                self.states += 1
                if self.states == tighten_at and self.root_bound < self.cut:
                    self.tighten()  # a search this large pays for the tighter bounds' tables
                elif self.states == buckets_at and self.root_bound < self.cut:
                    self.tighten(buckets=True)  # and this large, for their stage-count buckets
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    self.complete = False
                    return
                if len(cm._comm) > COMM_CACHE_LIMIT:  # memoised placements and transfer tables: start afresh
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
                        j, R, self.period_ts(pre, 0, min(R, N - j), links)) >= self.cut:
                    continue
                if self.max_stages is not None and pre.depth + 2 > self.max_stages:
                    continue
                prev = pre.last
                bound = self.cut
                W0, Bsum0 = (pre.W, pre.Bsum) if self.refined else (0.0, 0.0)  # formula 2: no fill/drain bound
                most = max(free)
                for m in range(1, min(R - 1, b) + 1):
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

    def reach(self, pre: _Prefix, j: int, m: int, multi: bool, n_rest: int, lo: int, base: float, W: float,
              Bsum: float, ts: list | None = None, first: bool = False) -> list:
        """The ends j2 of a new stage [j, j2) on m replicas that pass the bounds, with the first micro-batch
        reaching it after ``W`` and the last gradient leaving it ``Bsum`` before the end: [(j2, F, B, AR, D,
        the rest bounds' least L of a completion)]; ``ts``: period_rest's t per stage-count bucket of the
        rest, before the new stage's own U. ``first``: only the first such end (expand() asks again from it,
        with the transfer into the new stage priced)."""
        N, M, cut, Q, Qar, fill = self.N, self.M, self.cut, self.Q, self.Qar, self.fill
        fs, bs, ars, ds = self.stage_costs(j, m, multi)
        refined, ar_less = self.refined, self.ar_less
        pv = self.pv is not None and ts is not None
        out = []
        for j2 in range(lo, min(N, len(fs))):  # the lists end where M (F+B) alone reaches the cut
            f, bb, ar = fs[j2], bs[j2], ars[j2]
            if max(base, W + M * (f + bb) + (max(Bsum, ar - ar_less * bb) if refined else Bsum)) >= cut:
                break  # a longer new stage is only slower
            dn = ds[j2]
            if dn < 1:
                break  # and only bigger
            # the rest [j2, N) on the free devices: the least any split of it adds (bounds.rest_bound)
            low = W + max(Bsum + fill * (f + bb) + Q[j2][n_rest], f + Qar[j2][n_rest])
            if low >= cut:
                continue
            if pv:
                low = self.with_period(low, j2, n_rest, ts, f, bb, W, Bsum)
                if low >= cut:
                    continue
            out.append((j2, f, bb, ar, dn, low))
            if first:
                break
        return out

    def with_period(self, low: float, j2: int, n_rest: int, ts: list, f: float, bb: float, W: float,
                    Bsum: float) -> float:
        """``low`` raised to the period bound of a new stage [j, j2) (F ``f``, B ``bb``) after ``W`` and ``Bsum``
        and before the rest [j2, N) on ``n_rest`` devices (period_rest, ``ts`` from period_ts)."""
        hi, lo = (f, bb) if f > bb else (bb, f)
        x = W + Bsum + f + bb + self.period_rest(j2, n_rest, ts, hi, lo)
        return x if x > low else low

    def expand(self, states, pre: _Prefix, j: int, m: int, option: tuple, prev, lo: int, gate: dict) -> None:
        """Formula 5 for one placement of the new stage [j, j2) over every j2: L of prefix + new + rest."""
        N, M, ns, cm = self.N, self.M, self.ns, self.cm
        name, new, free2, n_rest, tail_eval, wide, key, perm, multi, comms = option
        refined = self.refined
        ends = gate[multi]  # the ends that pass the bounds before the transfer into the new stage is priced
        if not ends:
            return
        if not comms:
            comms += [cm.comm_pair(prev, new) if prev is not None else None, cm.comm_pair(new, tail_eval)]
        comm_in, comm_to_rest = comms
        if prev is not None:
            busy1, out1, in1, servers1, chain1, window1, hot1 = comm_in(j - 1)
            queue0 = pre.queue + (queues(pre.hot, comm_in.ports),)  # the last stage's, now that its next is known
            # formula 2: L >= M (F+B) of every stage; refined: L >= its chain >= W + M max(F, B) + the B below
            base = max(pre.lb, M * 2 * busy1 if not refined else pre.W + M * busy1 + pre.Bsum)
            if base >= self.cut:
                return
            F0, B0, AR0, E0, C0 = pre.F + [busy1], pre.B + [busy1], pre.AR + [0.0], pre.E + [busy1], pre.C + [chain1]
            Cw0 = pre.Cw + [window1]
            if refined:
                dev1 = max(pre.dev, out1 + pre.last_in)
                devd1 = max(pre.dev_drain, out1, in1)
                srv1 = dict(pre.servers)
                for s, tu, td in servers1:
                    u, d = srv1.get(s, NO_LOAD)
                    srv1[s] = (u + tu, d + td)
                srvmax1 = max((u + d for u, d in srv1.values()), default=0.0)
                srvd1 = max((u if u > d else d for u, d in srv1.values()), default=0.0)
                W1, Bsum1 = pre.W + busy1, pre.Bsum + chain1
            else:
                dev1, devd1, srv1, srvmax1, srvd1 = 0.0, 0.0, pre.servers, 0.0, 0.0
                W1 = Bsum1 = 0.0
            last_in1 = in1
            # without the period bound: checked below only for the ends that pass the cheaper ones (few do)
            ends = self.reach(pre, j, m, multi, n_rest, ends[0][0], base, W1, Bsum1)
            deferred = self.pv is not None
        else:
            base = pre.lb
            busy1, chain1 = 0.0, None
            F0, B0, AR0, E0, C0, Cw0 = [], [], [], [], [], []
            dev1, devd1, srv1, srvmax1, srvd1, last_in1 = 0.0, 0.0, {}, 0.0, 0.0, 0.0
            servers1 = ()
            W1 = Bsum1 = 0.0
            hot1, queue0 = (), ()
            deferred = False  # the gate's ends, with every bound
        ts1 = None  # period_rest's ts after the prefix, the transfer and the new stage (period_ts; on first use)

        def with_period(low: float, j2: int, f: float, bb: float) -> float:  # self.with_period after the transfer in
            nonlocal ts1
            if ts1 is None:
                ts1 = self.period_ts(pre, 1, min(n_rest, N - j - 1), max(srvmax1, dev1))
            return self.with_period(low, j2, n_rest, ts1, f, bb, W1, Bsum1)
        tails = self.tails(tail_eval)
        queue = (*queue0, queues(hot1, comm_to_rest.ports), False) if refined else None

        n_all = 2 * pre.depth + 3  # interleaved stages of prefix + new + rest
        users1, shared1 = None, False  # the prefix's and the transfer in's server link users (refined; on first use)

        def users_in() -> dict:
            nonlocal users1, shared1
            if users1 is None:
                users1 = add_users(pre.users, servers1, 2 * pre.depth - 1) if servers1 else pre.users
                shared1 = any(len(ups) > 1 or len(downs) > 1 for ups, downs in users1.values())
            return users1

        def feed_of(servers2) -> list | None:  # comm.feeds of prefix + new + rest (None: no server link shared)
            users_in()
            if not shared1:
                for s, tu, td in servers2:
                    ups, downs = users1.get(s, NO_USERS)
                    if (tu > 0 and ups) or (td > 0 and downs):
                        break
                else:
                    return None
            return feeds(add_users(users1, servers2, n_all - 2), n_all)

        def link_periods(servers2, out2, in2) -> tuple[float, float]:  # CostModel.link_periods of prefix + new + rest
            two = one = 0.0
            for s, tu, td in servers2:
                u, d = srv1.get(s, NO_LOAD)
                u += tu
                d += td
                if u + d > two:
                    two = u + d
                if u > one:
                    one = u
                if d > one:
                    one = d
            return max(dev1, out2 + last_in1, in2, srvmax1, two), max(devd1, out2, in2, srvd1, one)

        for j2, f, bb, ar, dn, rest_lb in ends:
            # reach's checks again: a plan recorded in this loop may have lowered the cut since
            lb = max(base, W1 + M * (f + bb) + (max(Bsum1, ar - self.ar_less * bb) if refined else Bsum1))
            if lb >= self.cut:
                break
            if rest_lb >= self.cut:  # reach's rest bounds, computed there
                continue
            busy2, out2, in2, servers2, chain2, window2, _ = comm_to_rest(j2 - 1)
            rest = tails[j2] or self.tail(j2, tail_eval)
            t_f, t_b, t_ar, t_e, t_d = rest
            skey = (pre.depth + 1, key) if self.max_stages is not None else key  # stage count limits what follows
            bucket = states[j2].get(skey)
            full = bucket is not None and len(bucket) >= self.beam
            floor = max(lb, rest_lb)
            if deferred and (not full or floor <= bucket[-1].floor):  # the period bound may decide it
                rest_lb = with_period(rest_lb, j2, f, bb)
                if rest_lb >= self.cut:
                    continue
                floor = max(lb, rest_lb)
            enters = not full or floor <= bucket[-1].floor  # (ties: by latency, below)
            # the new stage's ending (overlapped: costed once asked) and the plan's link period (refined model)
            e = None if self.overlap else bb
            periods = None if refined else (0.0, 0.0)
            if not enters:
                # the rest-as-one-stage's chain bounds this complete plan's L from below (formula 2: M (F+B) of
                # any stage); skip evaluating a plan that can neither beat the best nor enter the bucket
                quick = self.quick_floor(f, bb, busy2, chain2, W1, Bsum1, rest)
                if refined and quick < self.cut:  # the rest's own chain (refined_chains with K = 1)
                    e = cm.overlapped_ending(j, j2, new) if e is None else e
                    periods = link_periods(servers2, out2, in2)
                    quick = self.rest_chain(pre, chain1, f, bb, ar, busy1, busy2, chain2, W1, rest, e, periods[0])
                if quick >= self.cut:
                    continue
                if deferred:
                    rest_lb = with_period(rest_lb, j2, f, bb)
                    if rest_lb >= self.cut:
                        continue
                    floor = max(lb, rest_lb)
            self.transitions += 1
            e = cm.overlapped_ending(j, j2, new) if e is None else e
            period, drain = link_periods(servers2, out2, in2) if periods is None else periods
            F, B, AR, E, C, D = F0 + [f], B0 + [bb], AR0 + [ar], E0 + [e], C0 + [bb], pre.D + [dn]
            Cw = Cw0 + [bb]
            # formula 5's L of prefix + new + the rest as one stage, priced only where it decides something
            job = (busy2, t_f, t_b, t_ar, t_e, chain2, window2, t_d, period, drain, queue,
                   feed_of(servers2) if refined else None)
            complete = not wide and t_d >= 1  # a plan the search may record
            lat = low = None  # this plan's L; a lower bound on it (quick_floor, then rest_chain once ``tight``)
            tight = False

            def bound_below(limit: float) -> float:  # the lower bound, tightened only while it is below ``limit``
                nonlocal low, tight
                if low is None:
                    low, tight = self.quick_floor(f, bb, busy2, chain2, W1, Bsum1, rest), not refined
                if not tight and low < limit:
                    low = self.rest_chain(pre, chain1, f, bb, ar, busy1, busy2, chain2, W1, rest, e, period)
                    tight = True
                return low
            if not enters:  # it matters only if it beats the best: stop there
                lat, pol = self.plan_latency(F, B, AR, E, C, D, Cw, job, self.best[0])
            elif complete and bound_below(self.best[0]) < self.best[0]:  # may beat the best (2 in 20k on 8x8 do)
                lat, pol = self.plan_latency(F, B, AR, E, C, D, Cw, job)
            if complete and lat is not None and lat < self.best[0]:
                self.record(lat, pre.spans() + ((j, j2, new), (j2, N, tail_eval)), pre.policies + (name, "rest"), pol)
            if full:  # ranked by floor, then by L: priced only on a tie (a fifth of the transitions on 8x8)
                held = bucket[-1]
                if held.floor < floor:
                    continue
                if held.floor == floor:
                    if same_costs(held, (F, B, AR, E, C, D, Cw, job)):
                        continue  # the same L: the first stays (a quarter of the ties on 8x8)
                    first = self.prefix_latency(held)
                    if lat is None:
                        if bound_below(first) >= first:
                            continue  # L >= its bound >= the held one's: that one stays
                        lat = self.plan_latency(F, B, AR, E, C, D, Cw, job)[0]
                    if first <= lat:
                        continue
            relabelled = [0] * ns
            for s in range(ns):
                relabelled[perm[s]] = free2[s]
            nxt = _Prefix(pre, (j, j2, new), perm, tuple([perm[s] for s in new]), pre.depth + 1,
                          pre.policies + (name,), F, B, AR, E, C, D, lb, tuple(relabelled), lat,
                          {perm[s]: t for s, t in srv1.items()} if refined else {}, srvmax1, dev1, last_in1,
                          W1 + f, Bsum1 + bb, self.below(pre, chain1, bb, ar, e),
                          max(pre.fmax, busy1, f), floor, Cw, devd1, queue0,
                          tuple([(k, perm[w] if k == "down" else w) for k, w in hot1]),
                          users={perm[s]: t for s, t in users_in().items()} if refined else {},
                          job=job)
            if bucket is None or self.beam == 1:
                states[j2][skey] = [nxt]
            elif all(p.spans() != nxt.spans() for p in bucket):
                bucket.append(nxt)
                bucket.sort(key=lambda p: (p.floor, self.prefix_latency(p)))
                del bucket[self.beam:]


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
