"""The DP's transitions (formula 5): a new stage's ends that pass the bounds, priced, and the prefixes they make."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ..model.cost import LinkPeriods, Span
from ..model.transfers import NO_USERS, add_users, feeds, queues
from .bounds import Pruner
from .pricing import StageCosts
from .records import (
    Completion,
    Links,
    Option,
    PlanCosts,
    Prefix,
    SearchConfig,
    StageEnd,
    Start,
    Tail,
)

if TYPE_CHECKING:
    from ..model.transfers import CommLinks

NO_LOAD = (0.0, 0.0)  # a server's (uplink, downlink) ms per micro-batch before any transfer crosses it
NO_PERIODS = LinkPeriods(0.0, 0.0)  # formula 2's: it has no link periods


class Arrival:
    """A prefix, a placement of the new stage [j, .) after it and the transfer into it (``link_in``; None for the
    first stage): where the new stage starts (``start``), the links' loads with the transfer in (``links``, refined
    model) and what is priced once asked (the server links' users, the period bound's ts)."""

    __slots__ = ("pre", "j", "option", "skey", "refined", "start", "link_in", "busy", "chain", "servers", "links",
                 "server_drain", "queue", "n_all", "shared", "period_ts")
    chain: float | None  # the transfer in's share of a round trip (None: the first stage)
    period_ts: list | None  # Pruner.period_ts of the rest after it (None: not made yet)

    def __init__(self, pre: Prefix, j: int, option: Option, M: int, refined: bool, counted: bool):
        """``option.comms`` priced (the transfer in is None for the first stage); ``counted``: states are keyed by
        their stage count too (max_stages)."""
        pair_in, pair_out = option.comms
        self.pre, self.j, self.option, self.refined = pre, j, option, refined
        self.skey = (pre.depth + 1, option.key) if counted else option.key  # the new state's key
        self.n_all = 2 * pre.depth + 3  # interleaved stages of prefix + new + rest
        self.shared, self.period_ts, self.server_drain = False, None, 0.0
        if pair_in is None:  # the first stage: nothing before it
            self.start, self.busy, self.chain, self.servers = Start(pre.lb, 0.0, 0.0), 0.0, None, ()
            self.link_in, self.links = None, Links(users=None)
        else:
            self.link_in = pair_in(j - 1)
            self._across(self.link_in, pair_in.ports, M)
        self.queue = (*self.links.queue, queues(self.links.hot, pair_out.ports), False) if refined else None

    def _across(self, link: "CommLinks", ports_in, M: int) -> None:
        """The transfer into the new stage; ``start.base``: the least L by the stages so far (formula 2: M (F+B) of
        every stage; refined: W + M max(F, B) + the B below)."""
        pre, refined, was = self.pre, self.refined, self.pre.links
        busy, chain = link.busiest, link.chain
        self.busy, self.chain, self.servers = busy, chain, link.servers
        queue = was.queue + (queues(was.hot, ports_in),)  # the last stage's, now that its next is known
        base = max(pre.lb, M * 2 * busy if not refined else pre.forward_sum + M * busy + pre.backward_sum)
        # Links by position below: a third of the keywords' cost, and an arrival is made per placement tried
        if not refined:
            self.start = Start(base, 0.0, 0.0)
            self.links = Links(was.servers, 0.0, 0.0, link.receive, 0.0, queue, link.hot, None)
            return
        loads = dict(was.servers)
        for s, tu, td in link.servers:
            u, d = loads.get(s, NO_LOAD)
            loads[s] = (u + tu, d + td)
        self.server_drain = max((u if u > d else d for u, d in loads.values()), default=0.0)
        self.start = Start(base, pre.forward_sum + busy, pre.backward_sum + chain)
        self.links = Links(loads, max((u + d for u, d in loads.values()), default=0.0),  # (servers, server_max,)
                           max(was.dev, link.send + was.last_in), link.receive,  # (dev, last_in,)
                           max(was.dev_drain, link.send, link.receive), queue, link.hot, None)  # (dev_drain, ...)

    def users(self) -> dict:
        """The prefix's and the transfer in's server link users (transfers.add_users; refined model, on first use)."""
        links = self.links
        users = links.users
        if users is None:
            pre, servers = self.pre, self.servers
            was = cast(dict, pre.links.users)  # a Prefix's links hold their users
            users = links.users = add_users(was, servers, 2 * pre.depth - 1) if servers else was
            self.shared = any(len(ups) > 1 or len(downs) > 1 for ups, downs in users.values())
        return users

    def feed_of(self, link: "CommLinks") -> list | None:
        """transfers.feeds of prefix + new + rest, ``link`` the transfer to the rest (None: no server link is
        shared)."""
        users = self.users()
        if not self.shared:
            for s, tu, td in link.servers:
                ups, downs = users.get(s, NO_USERS)
                if (tu > 0 and ups) or (td > 0 and downs):
                    break
            else:
                return None
        return feeds(add_users(users, link.servers, self.n_all - 2), self.n_all)

    def link_periods(self, link: "CommLinks") -> LinkPeriods:
        """CostModel.link_periods of prefix + new + rest, ``link`` the transfer to the rest: (link period, drain
        period)."""
        loads, out, into = self.links.servers, link.send, link.receive
        two = one = 0.0
        for s, tu, td in link.servers:
            u, d = loads.get(s, NO_LOAD)
            u += tu
            d += td
            if u + d > two:
                two = u + d
            if u > one:
                one = u
            if d > one:
                one = d
        links = self.links
        return LinkPeriods(max(links.dev, out + links.last_in, into, links.server_max, two),
                           max(links.dev_drain, out, into, self.server_drain, one))

    def completed(self, end: StageEnd, e: float, link: "CommLinks", rest: Tail, periods: LinkPeriods) -> PlanCosts:
        """Formula 5's inputs: the prefix's interleaved stages, the transfer in and the new stage ending at ``end``
        (overlapped ending ``e``), completed by the transfer ``link`` into the rest, the rest as one stage and the
        plan's link ``periods``."""
        c, f, b, t = self.pre.costs, end.f, end.b, self.link_in
        t_f, t_b, t_ar, t_e, t_d = rest
        if t is None:
            F, B, AR, E, C, W = [f], [b], [end.allreduce], [e], [b], [b]
        else:
            busy = t.busiest
            F, B, AR = c.F + [busy, f], c.B + [busy, b], c.AR + [0.0, end.allreduce]
            E, C, W = c.E + [busy, e], c.chain + [t.chain, b], c.window + [t.window, b]
        return PlanCosts(F, B, AR, E, C, c.D + [end.fits], W,
                         Completion(link.busiest, t_f, t_b, t_ar, t_e, link.chain, link.window, t_d, periods.period,
                                    periods.drain, self.queue, self.feed_of(link) if self.refined else None))


class Reached:
    """An end of a new stage that passed the cheap checks, on its way to formula 5: its bounds (``lb`` of the
    stages so far, ``rest_floor`` of the rest, ``floor`` the larger: the memo's rank), the transfer to the rest and
    the rest, the state it would enter (``bucket``, ``full``) and what pricing it works out (the overlapped ending
    ``e``, the link ``periods``, a lower bound ``low`` on its L, ``tight`` once that is rest_chain's)."""

    __slots__ = ("end", "lb", "rest_floor", "floor", "link", "rest", "bucket", "full", "e", "periods", "low",
                 "tight")
    e: float | None
    periods: LinkPeriods | None
    low: float | None

    def __init__(self, end: StageEnd, lb: float, rest_floor: float, link: "CommLinks", rest: Tail,
                 bucket: list | None, full: bool):
        self.end, self.lb, self.rest_floor, self.floor = end, lb, rest_floor, max(lb, rest_floor)
        self.link, self.rest, self.bucket, self.full = link, rest, bucket, full
        self.e = self.periods = self.low = None
        self.tight = False


class Expander:
    """Formula 5 from one prefix (a DP state) and one placement of the new stage: every end of it that the bounds
    let through, priced, and the prefixes that enter the states of their ends. ``count``: transitions made."""

    def __init__(self, costs: StageCosts, pruner: Pruner, config: SearchConfig, servers: int):
        cm = costs.cm
        self.cm, self.M, self.N, self.ns = cm, costs.M, cm.num_layers, servers
        self.refined, self.overlap = config.refined, config.overlap
        self.beam, self.max_stages = config.beam, config.max_stages
        self.costs, self.pruner, self.incumbent = costs, pruner, costs.incumbent
        self.states: list = []  # per layer j, the DP's states there (DPSearch.run sets them)
        self.count = 0

    def expand(self, pre: Prefix, j: int, option: Option, gate: dict) -> None:
        """Formula 5 for one placement of the new stage [j, j2) over every j2 that passes ``gate`` (its ends per
        whether the stage spans servers, before the transfer into it is priced): L of prefix + new + rest."""
        ends = gate[option.multi]
        if not ends:
            return
        comms = option.comms
        if not comms:
            comms += [self.cm.comm_pair(pre.last, option.new) if pre.last is not None else None,
                      self.cm.comm_pair(option.new, option.tail)]
        arr = Arrival(pre, j, option, self.M, self.refined, self.max_stages is not None)
        if pre.last is None:
            self._ends(arr, ends, False)  # the gate's ends, with every bound
        elif arr.start.base < self.incumbent.bar:
            # without the period bound: checked below only for the ends that pass the cheaper ones (few do)
            new = self.costs.stage_costs(j, len(option.new), option.multi)
            self._ends(arr, self.pruner.ends(new, option.n_rest, arr.start, ends[0].end), self.pruner.has_period_bound)

    def _period(self, arr: Arrival, low: float, end: StageEnd) -> float:
        """``low`` raised to the period bound of the new stage after the transfer into it (its ts made on first
        use)."""
        ts, n_rest, links = arr.period_ts, arr.option.n_rest, arr.links
        if ts is None:
            ts = arr.period_ts = self.pruner.period_ts(arr.pre, 1, min(n_rest, self.N - arr.j - 1),
                                                       max(links.server_max, links.dev))
        return self.pruner.with_period(low, end.end, end.f, end.b, n_rest, ts, arr.start)

    def _ends(self, arr: Arrival, ends: list[StageEnd], deferred: bool) -> None:
        """Each of ``ends`` after the transfer into the new stage: the cheap checks here (most ends stop at them),
        then :meth:`_transition`, through :meth:`_outside` where the prefix would not enter its state."""
        inc, refined, beam = self.incumbent, self.refined, self.beam
        quick_floor, states, skey, start = self.pruner.quick_floor, self.states, arr.skey, arr.start
        comm_to_rest = arr.option.comms[1]
        tails, tail_layout = self.costs.tails(arr.option.tail), arr.option.tail
        for end in ends:
            j2, _, b, _, _, lb, rest_floor = end
            if lb >= inc.bar:  # (Pruner.ends checked it: a plan recorded in this loop may have lowered the bar since)
                break
            if rest_floor >= inc.bar:  # the rest bounds, from Pruner.ends
                continue
            link = comm_to_rest(j2 - 1)
            rest = tails[j2] or self.costs.tail(j2, tail_layout)
            bucket = states[j2].get(skey)
            full = bucket is not None and len(bucket) >= beam
            floor = max(lb, rest_floor)
            if deferred and (not full or floor <= bucket[-1].floor):  # the period bound may decide it
                rest_floor = self._period(arr, rest_floor, end)
                if rest_floor >= inc.bar:
                    continue
                floor = max(lb, rest_floor)
            if not full or floor <= bucket[-1].floor:  # (ties: by latency, in _keeps)
                reached = Reached(end, lb, rest_floor, link, rest, bucket, full)
                reached.e = None if self.overlap else b
                reached.periods = None if refined else NO_PERIODS
                self._transition(arr, reached, True)
            else:  # its prefix would not enter: it matters only as a complete plan that beats the best
                quick = quick_floor(end, link, rest, start)  # (most stop here)
                if quick < inc.bar:
                    self._outside(arr, Reached(end, lb, rest_floor, link, rest, bucket, True), deferred, quick)

    def _outside(self, arr: Arrival, r: Reached, deferred: bool, quick: float) -> None:
        """An end whose prefix would not enter its state, whose plan's L is at least ``quick`` (quick_floor): the
        rest-as-one-stage's chain bounds its L from below (formula 2: M (F+B) of any stage); skip pricing a plan
        that can neither beat the best nor enter the bucket."""
        inc, end = self.incumbent, r.end
        r.e = None if self.overlap else end.b
        r.periods = None if self.refined else NO_PERIODS
        if self.refined:  # the rest's own chain (refined_chains with K = 1)
            r.e = self.cm.overlapped_ending(arr.j, end.end, arr.option.new) if r.e is None else r.e
            r.periods = arr.link_periods(r.link)
            quick = self.pruner.rest_chain(arr, end, r.link, r.rest, r.e, r.periods.period)
        if quick >= inc.bar:
            return
        if deferred:
            r.rest_floor = self._period(arr, r.rest_floor, end)
            if r.rest_floor >= inc.bar:
                return
            r.floor = max(r.lb, r.rest_floor)
        self._transition(arr, r, False)

    def _transition(self, arr: Arrival, r: Reached, enters: bool) -> None:
        """Formula 5's L of prefix + new stage + the rest as one stage, priced only where it decides something: a
        complete plan that may beat the best is recorded; the prefix enters the state of its end if it ranks there
        (``enters``: it may)."""
        self.count += 1
        inc, costs, option, end = self.incumbent, self.costs, arr.option, r.end
        if r.e is None:
            r.e = self.cm.overlapped_ending(arr.j, end.end, option.new)
        if r.periods is None:
            r.periods = arr.link_periods(r.link)
        planned = arr.completed(end, r.e, r.link, r.rest, r.periods)
        complete = not option.wide and r.rest.fits >= 1  # a plan the search may record
        lat = None  # this plan's L (r.low: a lower bound on it, quick_floor, then rest_chain once ``tight``)
        if not enters:  # it matters only if it beats the best: stop there
            lat, pol = costs.plan_latency(planned, inc.latency)
        elif complete:
            if self._bound_below(arr, r, inc.latency) < inc.latency:  # may beat the best (few do)
                lat, pol = costs.plan_latency(planned)
        if complete and lat is not None and lat < inc.latency:
            pre = arr.pre
            inc.offer(lat, pre.spans() + (Span(arr.j, end.end, option.new), Span(end.end, self.N, option.tail)),
                      pre.policies + (option.policy, "rest"), pol)
        if r.full:  # ranked by floor, then by L: priced only on a tie
            keep, lat = self._keeps(cast(list, r.bucket)[-1], planned, lat, arr, r)  # (full: a bucket)
            if not keep:
                return
        self._enter(arr, r, planned, lat)

    def _bound_below(self, arr: Arrival, r: Reached, limit: float) -> float:
        """``r.low``, a lower bound on the plan's L: quick_floor first, rest_chain (``r.tight``) only while the bound
        is below ``limit``; returns it."""
        if r.low is None:
            r.low, r.tight = self.pruner.quick_floor(r.end, r.link, r.rest, arr.start), not self.refined
        if not r.tight and r.low < limit:
            if r.e is None or r.periods is None:
                raise RuntimeError("_bound_below: the plan's ending and link periods are not priced yet")
            r.low = self.pruner.rest_chain(arr, r.end, r.link, r.rest, r.e, r.periods.period)
            r.tight = True
        return r.low

    def _keeps(self, held: Prefix, planned: PlanCosts, lat: float | None, arr: Arrival,
               r: Reached) -> tuple[bool, float | None]:
        """(whether a full bucket takes the candidate over its last prefix ``held``: a lower floor, or an equal one
        and a lower L; the candidate's L as far as that priced it, None: not priced)."""
        if held.floor < r.floor:
            return False, lat
        if held.floor == r.floor:
            if held.costs == planned:
                return False, lat  # the same L: the first stays
            first = self.costs.prefix_latency(held)
            if lat is None:
                if self._bound_below(arr, r, first) >= first:
                    return False, lat  # L >= its bound >= the held one's: that one stays
                lat = self.costs.plan_latency(planned)[0]
            if first <= lat:
                return False, lat
        return True, lat

    def _enter(self, arr: Arrival, r: Reached, planned: PlanCosts, lat: float | None) -> None:
        """The prefix of prefix + new stage, in the new state's server labels, into the state of its end."""
        pre, option, refined, end, links, e = arr.pre, arr.option, self.refined, r.end, arr.links, r.e
        if e is None:  # (_transition priced it)
            raise RuntimeError("_enter: the plan's overlapped ending is not priced yet")
        perm = option.perm
        relabelled = [0] * self.ns
        for s in range(self.ns):
            relabelled[perm[s]] = option.free[s]
        nxt = Prefix(parent=pre, span=Span(arr.j, end.end, option.new), perm=perm,
                     last=tuple([perm[s] for s in option.new]), depth=pre.depth + 1,
                     policies=pre.policies + (option.policy,), free=tuple(relabelled), costs=planned, latency=lat,
                     lb=r.lb, floor=r.floor, forward_sum=arr.start.forward_sum + end.f,
                     backward_sum=arr.start.backward_sum + end.b,
                     below=self.pruner.below(pre, arr.chain, end.b, end.allreduce, e),
                     fmax=max(pre.fmax, arr.busy, end.f),
                     links=Links(servers={perm[s]: t for s, t in links.servers.items()} if refined else {},
                                 server_max=links.server_max, dev=links.dev, last_in=links.last_in,
                                 dev_drain=links.dev_drain, queue=links.queue,
                                 hot=tuple([(k, perm[w] if k == "down" else w) for k, w in links.hot]),
                                 users={perm[s]: t for s, t in arr.users().items()} if refined else {}))
        bucket = r.bucket
        if bucket is None or self.beam == 1:
            self.states[end.end][arr.skey] = [nxt]
        elif all(p.spans() != nxt.spans() for p in bucket):
            bucket.append(nxt)
            bucket.sort(key=lambda p: (p.floor, self.costs.prefix_latency(p)))
            del bucket[self.beam:]
