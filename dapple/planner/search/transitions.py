"""The DP's transitions (paper formula 5): a new stage's ends that pass the bounds, and the prefixes they make."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..model.transfers import NO_USERS, add_users, feeds, queues
from .pruning import Pruner
from .records import Incumbent, Job, Option, Prefix, SearchConfig
from .stage_costs import StageCosts, same_costs

if TYPE_CHECKING:
    from ..model.cost import CostModel

NO_LOAD = (0.0, 0.0)  # a server's (uplink, downlink) ms per micro-batch before any transfer crosses it
# an end of a new stage that passes the bounds (Expander.reach), a plain tuple (the search makes very many):
# (j2, F, B, AllReduce, slices that fit, the rest bounds' least L of a completion)
End = tuple


class Arrival:
    """A prefix and the transfer into a new stage after it: the interleaved costs up to the new stage (F0, B0, ...),
    the transfer's own (busy1, chain1, ...: names ending in 1 hold the prefix with the transfer), the links' loads
    (refined model) and what is priced once asked (the server link users, the period bound's ts)."""

    __slots__ = ("pre", "base", "busy1", "chain1", "hot1", "servers1", "queue0", "F0", "B0", "AR0", "E0", "C0",
                 "Cw0", "dev1", "devd1", "srv1", "srvmax1", "srvd1", "W1", "Bsum1", "last_in1", "queue", "n_all",
                 "users1", "shared1", "ts")

    def __init__(self, pre: Prefix, link: tuple | None, ports_in, ports_out, M: int, refined: bool):
        """After ``pre`` over the transfer ``link`` (CostModel.comm_links at the cut; None: the first stage, nothing
        before it); ``ports_in``, ``ports_out``: comm_pair.ports of the transfers in and to the rest (refined)."""
        self.pre, self.n_all = pre, 2 * pre.depth + 3  # interleaved stages of prefix + new + rest
        self.users1 = self.ts = None  # (on first use)
        self.shared1 = False
        self.dev1 = self.devd1 = self.srvmax1 = self.srvd1 = self.last_in1 = self.W1 = self.Bsum1 = 0.0
        if link is None:
            self.base, self.busy1, self.chain1, self.hot1, self.servers1, self.queue0 = pre.lb, 0.0, None, (), (), ()
            self.F0, self.B0, self.AR0, self.E0, self.C0, self.Cw0, self.srv1 = [], [], [], [], [], [], {}
        else:
            self._across(link, ports_in, M, refined)
        self.queue = (*self.queue0, queues(self.hot1, ports_out), False) if refined else None

    def _across(self, link: tuple, ports_in, M: int, refined: bool) -> None:
        """The transfer into the new stage; ``base``: the least L by the stages so far (formula 2: M (F+B) of every
        stage; refined: W + M max(F, B) + the B below)."""
        pre = self.pre
        busy1, out1, in1, servers1, chain1, window1, hot1 = link
        self.busy1, self.chain1, self.hot1, self.servers1 = busy1, chain1, hot1, servers1
        self.queue0 = pre.queue + (queues(pre.hot, ports_in),)  # the last stage's, now that its next is known
        self.base = max(pre.lb, M * 2 * busy1 if not refined else pre.W + M * busy1 + pre.Bsum)
        self.F0, self.B0, self.AR0, self.E0 = pre.F + [busy1], pre.B + [busy1], pre.AR + [0.0], pre.E + [busy1]
        self.C0, self.Cw0 = pre.C + [chain1], pre.Cw + [window1]
        self.last_in1 = in1
        if not refined:
            self.srv1 = pre.servers
            return
        self.dev1 = max(pre.dev, out1 + pre.last_in)
        self.devd1 = max(pre.dev_drain, out1, in1)
        srv1 = self.srv1 = dict(pre.servers)
        for s, tu, td in servers1:
            u, d = srv1.get(s, NO_LOAD)
            srv1[s] = (u + tu, d + td)
        self.srvmax1 = max((u + d for u, d in srv1.values()), default=0.0)
        self.srvd1 = max((u if u > d else d for u, d in srv1.values()), default=0.0)
        self.W1, self.Bsum1 = pre.W + busy1, pre.Bsum + chain1

    def users(self) -> dict:
        """The prefix's and the transfer in's server link users (comm.add_users; refined model, on first use)."""
        users1 = self.users1
        if users1 is None:
            pre, servers1 = self.pre, self.servers1
            users1 = self.users1 = add_users(pre.users, servers1, 2 * pre.depth - 1) if servers1 else pre.users
            self.shared1 = any(len(ups) > 1 or len(downs) > 1 for ups, downs in users1.values())
        return users1

    def feed_of(self, servers2: tuple) -> list | None:
        """comm.feeds of prefix + new + rest, the transfer to the rest loading ``servers2`` (None: no server link
        is shared)."""
        users1 = self.users()
        if not self.shared1:
            for s, tu, td in servers2:
                ups, downs = users1.get(s, NO_USERS)
                if (tu > 0 and ups) or (td > 0 and downs):
                    break
            else:
                return None
        return feeds(add_users(users1, servers2, self.n_all - 2), self.n_all)

    def link_periods(self, servers2: tuple, out2: float, in2: float) -> tuple[float, float]:
        """CostModel.link_periods of prefix + new + rest: (link period, drain period)."""
        srv1 = self.srv1
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
        return (max(self.dev1, out2 + self.last_in1, in2, self.srvmax1, two),
                max(self.devd1, out2, in2, self.srvd1, one))


class Expander:
    """Formula 5 from one prefix (a DP state) and one placement of the new stage: every end of it that the bounds
    let through, priced, and the prefixes that enter the states of their ends. ``count``: transitions made."""

    def __init__(self, cm: "CostModel", config: SearchConfig, M: int, servers: int, costs: StageCosts,
                 pruner: Pruner, incumbent: Incumbent):
        self.cm, self.M, self.N, self.ns = cm, M, cm.num_layers, servers
        self.refined, self.overlap = config.refined, config.overlap
        self.beam, self.max_stages = config.beam, config.max_stages
        self.costs, self.pruner, self.incumbent = costs, pruner, incumbent
        self.count = 0

    def reach(self, pre: Prefix, j: int, m: int, multi: bool, n_rest: int, lo: int, base: float, W: float,
              Bsum: float, ts: list | None = None, first: bool = False) -> list[End]:
        """The ends j2 >= ``lo`` of a new stage [j, j2) on m replicas that pass the bounds, with the first
        micro-batch reaching it after ``W`` and the last gradient leaving it ``Bsum`` before the end; ``ts``:
        period_rest's t per stage-count bucket of the rest, before the new stage's own U. ``first``: only the first
        such end (expand() asks again from it, with the transfer into the new stage priced)."""
        pruner = self.pruner
        N, M, cut, Q, Qar, fill = self.N, self.M, self.incumbent.cut, pruner.Q, pruner.Qar, pruner.fill
        fs, bs, ars, ds = self.costs.stage_costs(j, m, multi)
        refined, ar_less = self.refined, pruner.ar_less
        pv = pruner.pv is not None and ts is not None
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
                low = pruner.with_period(low, j2, n_rest, ts, f, bb, W, Bsum)
                if low >= cut:
                    continue
            out.append((j2, f, bb, ar, dn, low))
            if first:
                break
        return out

    def expand(self, states: list, pre: Prefix, j: int, m: int, option: Option, prev, gate: dict) -> None:
        """Formula 5 for one placement of the new stage [j, j2) over every j2 that passes ``gate`` (its ends per
        whether the stage spans servers, before the transfer into it is priced): L of prefix + new + rest."""
        ends = gate[option.multi]
        if not ends:
            return
        comms = option.comms
        if not comms:
            comms += [self.cm.comm_pair(prev, option.new) if prev is not None else None,
                      self.cm.comm_pair(option.new, option.tail)]
        comm_in, comm_to_rest = comms
        first = prev is None
        arr = Arrival(pre, None if first else comm_in(j - 1), None if first else comm_in.ports, comm_to_rest.ports,
                      self.M, self.refined)
        if first:
            self._ends(states, arr, option, j, ends, False)  # the gate's ends, with every bound
        elif arr.base < self.incumbent.cut:
            # without the period bound: checked below only for the ends that pass the cheaper ones (few do)
            ends = self.reach(pre, j, m, option.multi, option.n_rest, ends[0][0], arr.base, arr.W1, arr.Bsum1)
            self._ends(states, arr, option, j, ends, self.pruner.pv is not None)

    def _period(self, arr: Arrival, low: float, j: int, j2: int, f: float, bb: float, n_rest: int) -> float:
        """``low`` raised to the period bound of the new stage [j, j2) after the transfer into it (Pruner.with_period;
        its ts made on first use)."""
        ts = arr.ts
        if ts is None:
            ts = arr.ts = self.pruner.period_ts(arr.pre, 1, min(n_rest, self.N - j - 1), max(arr.srvmax1, arr.dev1))
        return self.pruner.with_period(low, j2, n_rest, ts, f, bb, arr.W1, arr.Bsum1)

    def _ends(self, states: list, arr: Arrival, option: Option, j: int, ends: list[End], deferred: bool) -> None:
        """Each of ``ends`` after the transfer into the new stage: the cheap checks here (most ends stop at them),
        then :meth:`_transition`, through :meth:`_outside` where the prefix would not enter its state."""
        inc, M, refined, ar_less, beam = self.incumbent, self.M, self.refined, self.pruner.ar_less, self.beam
        quick_floor = self.pruner.quick_floor
        W1, Bsum1, base, n_rest, comm_to_rest = arr.W1, arr.Bsum1, arr.base, option.n_rest, option.comms[1]
        tails, tail_eval = self.costs.tails(option.tail), option.tail
        skey = (arr.pre.depth + 1, option.key) if self.max_stages is not None else option.key  # (stage count too)
        for end in ends:
            j2, f, bb, ar, dn, rest_lb = end
            # reach's checks again: a plan recorded in this loop may have lowered the cut since
            lb = max(base, W1 + M * (f + bb) + (max(Bsum1, ar - ar_less * bb) if refined else Bsum1))
            if lb >= inc.cut:
                break
            if rest_lb >= inc.cut:  # reach's rest bounds, computed there
                continue
            link = comm_to_rest(j2 - 1)
            rest = tails[j2] or self.costs.tail(j2, tail_eval)
            bucket = states[j2].get(skey)
            full = bucket is not None and len(bucket) >= beam
            floor = max(lb, rest_lb)
            if deferred and (not full or floor <= bucket[-1].floor):  # the period bound may decide it
                rest_lb = self._period(arr, rest_lb, j, j2, f, bb, n_rest)
                if rest_lb >= inc.cut:
                    continue
                floor = max(lb, rest_lb)
            if not full or floor <= bucket[-1].floor:  # (ties: by latency, in _keeps)
                self._transition(states, arr, option, j, end, lb, floor, link, rest, skey, bucket, full, True,
                                 None if self.overlap else bb, None if refined else (0.0, 0.0))
            else:  # its prefix would not enter: it matters only as a complete plan that beats the best
                busy2, _, _, _, chain2, _, _ = link
                quick = quick_floor(f, bb, busy2, chain2, W1, Bsum1, rest)  # (most stop here)
                if quick < inc.cut:
                    self._outside(states, arr, option, j, end, lb, rest_lb, link, rest, skey, bucket, deferred, quick)

    def _outside(self, states: list, arr: Arrival, option: Option, j: int, end: End, lb: float, rest_lb: float,
                 link: tuple, rest: tuple, skey, bucket: list, deferred: bool, quick: float) -> None:
        """An end whose prefix would not enter its state, whose plan's L is at least ``quick`` (quick_floor): the
        rest-as-one-stage's chain bounds its L from below (formula 2: M (F+B) of any stage); skip pricing a plan
        that can neither beat the best nor enter the bucket."""
        inc, refined, pruner = self.incumbent, self.refined, self.pruner
        j2, f, bb, ar, dn, _ = end
        busy2, out2, in2, servers2, chain2, _, _ = link
        e = None if self.overlap else bb
        periods = None if refined else (0.0, 0.0)
        if refined:  # the rest's own chain (refined_chains with K = 1)
            e = self.cm.overlapped_ending(j, j2, option.new) if e is None else e
            periods = arr.link_periods(servers2, out2, in2)
            quick = pruner.rest_chain(arr.pre, arr.chain1, f, bb, ar, arr.busy1, busy2, chain2, arr.W1, rest, e,
                                      periods[0])
        if quick >= inc.cut:
            return
        floor = max(lb, rest_lb)
        if deferred:
            rest_lb = self._period(arr, rest_lb, j, j2, f, bb, option.n_rest)
            if rest_lb >= inc.cut:
                return
            floor = max(lb, rest_lb)
        self._transition(states, arr, option, j, end, lb, floor, link, rest, skey, bucket, True, False, e, periods)

    def _transition(self, states: list, arr: Arrival, option: Option, j: int, end: End, lb: float, floor: float,
                    link: tuple, rest: tuple, skey, bucket: list | None, full: bool, enters: bool, e: float | None,
                    periods: tuple | None) -> None:
        """Formula 5's L of prefix + new stage + the rest as one stage, priced only where it decides something: a
        complete plan that may beat the best is recorded; the prefix enters the state of its end if it ranks there."""
        self.count += 1
        inc, costs, refined = self.incumbent, self.costs, self.refined
        j2, f, bb, ar, dn, _ = end
        busy2, out2, in2, servers2, chain2, window2, _ = link
        e = self.cm.overlapped_ending(j, j2, option.new) if e is None else e
        period, drain = arr.link_periods(servers2, out2, in2) if periods is None else periods
        F, B, AR, E, C, D = arr.F0 + [f], arr.B0 + [bb], arr.AR0 + [ar], arr.E0 + [e], arr.C0 + [bb], arr.pre.D + [dn]
        Cw = arr.Cw0 + [bb]
        t_f, t_b, t_ar, t_e, t_d = rest
        job = Job(busy2, t_f, t_b, t_ar, t_e, chain2, window2, t_d, period, drain, arr.queue,
                  arr.feed_of(servers2) if refined else None)
        complete = not option.wide and t_d >= 1  # a plan the search may record
        lat = low = None  # this plan's L; a lower bound on it (quick_floor, then rest_chain once ``tight``)
        tight = False
        if not enters:  # it matters only if it beats the best: stop there
            lat, pol = costs.plan_latency(F, B, AR, E, C, D, Cw, job, inc.latency)
        elif complete:
            low, tight = self._bound_below(arr, f, bb, ar, link, rest, e, period, inc.latency, low, tight)
            if low < inc.latency:  # may beat the best (few do)
                lat, pol = costs.plan_latency(F, B, AR, E, C, D, Cw, job)
        if complete and lat is not None and lat < inc.latency:
            pre = arr.pre
            inc.offer(lat, pre.spans() + ((j, j2, option.new), (j2, self.N, option.tail)),
                      pre.policies + (option.policy, "rest"), pol)
        costed = (F, B, AR, E, C, D, Cw, job)
        if full:  # ranked by floor, then by L: priced only on a tie
            keep, lat = self._keeps(bucket[-1], floor, costed, lat, arr, f, bb, ar, link, rest, e, period, low, tight)
            if not keep:
                return
        self._enter(states, arr, option, j, j2, lb, floor, costed, lat, f, bb, ar, e, skey, bucket)

    def _bound_below(self, arr: Arrival, f: float, bb: float, ar: float, link: tuple, rest: tuple, e: float,
                     period: float, limit: float, low: float | None, tight: bool) -> tuple[float, bool]:
        """(a lower bound on the plan's L, whether it is the tight one): quick_floor first, rest_chain only while
        the bound is below ``limit`` (``low``, ``tight``: what an earlier ask gave)."""
        busy2, _, _, _, chain2, _, _ = link
        if low is None:
            low, tight = self.pruner.quick_floor(f, bb, busy2, chain2, arr.W1, arr.Bsum1, rest), not self.refined
        if not tight and low < limit:
            low = self.pruner.rest_chain(arr.pre, arr.chain1, f, bb, ar, arr.busy1, busy2, chain2, arr.W1, rest, e,
                                         period)
            tight = True
        return low, tight

    def _keeps(self, held: Prefix, floor: float, costed: tuple, lat: float | None, arr: Arrival, f: float,
               bb: float, ar: float, link: tuple, rest: tuple, e: float, period: float, low: float | None,
               tight: bool) -> tuple[bool, float | None]:
        """(whether a full bucket takes the candidate over its last prefix ``held``: a lower floor, or an equal one
        and a lower L; the candidate's L as far as that priced it, None: not priced)."""
        if held.floor < floor:
            return False, lat
        if held.floor == floor:
            if same_costs(held, costed):
                return False, lat  # the same L: the first stays
            first = self.costs.prefix_latency(held)
            if lat is None:
                low, tight = self._bound_below(arr, f, bb, ar, link, rest, e, period, first, low, tight)
                if low >= first:
                    return False, lat  # L >= its bound >= the held one's: that one stays
                lat = self.costs.plan_latency(*costed)[0]
            if first <= lat:
                return False, lat
        return True, lat

    def _enter(self, states: list, arr: Arrival, option: Option, j: int, j2: int, lb: float, floor: float,
               costed: tuple, lat: float | None, f: float, bb: float, ar: float, e: float, skey,
               bucket: list | None) -> None:
        """The prefix of prefix + new stage, in the new state's server labels, into the state of its end."""
        pre, perm, refined = arr.pre, option.perm, self.refined
        F, B, AR, E, C, D, Cw, job = costed
        relabelled = [0] * self.ns
        for s in range(self.ns):
            relabelled[perm[s]] = option.free[s]
        nxt = Prefix(parent=pre, span=(j, j2, option.new), perm=perm, last=tuple([perm[s] for s in option.new]),
                     depth=pre.depth + 1, policies=pre.policies + (option.policy,), F=F, B=B, AR=AR, E=E, C=C, D=D,
                     lb=lb, free=tuple(relabelled), latency=lat,
                     servers={perm[s]: t for s, t in arr.srv1.items()} if refined else {},
                     server_max=arr.srvmax1, dev=arr.dev1, last_in=arr.last_in1, W=arr.W1 + f, Bsum=arr.Bsum1 + bb,
                     below=self.pruner.below(pre, arr.chain1, bb, ar, e), fmax=max(pre.fmax, arr.busy1, f),
                     floor=floor, Cw=Cw, dev_drain=arr.devd1, queue=arr.queue0,
                     hot=tuple([(k, perm[w] if k == "down" else w) for k, w in arr.hot1]),
                     users={perm[s]: t for s, t in arr.users().items()} if refined else {}, job=job)
        if bucket is None or self.beam == 1:
            states[j2][skey] = [nxt]
        elif all(p.spans() != nxt.spans() for p in bucket):
            bucket.append(nxt)
            bucket.sort(key=lambda p: (p.floor, self.costs.prefix_latency(p)))
            del bucket[self.beam:]
