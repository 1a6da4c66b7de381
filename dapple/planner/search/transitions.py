"""The DP's transitions (paper formula 5): a new stage's ends that pass the bounds, and the prefixes they make."""

from __future__ import annotations

from math import inf as INF
from math import nextafter

from ..model.transfers import NO_USERS, add_users, feeds, queues
from .memo import _Prefix
from .stage_costs import same_costs

NO_LOAD = (0.0, 0.0)  # a server's (uplink, downlink) ms per micro-batch before any transfer crosses it


class _Transitions:
    """Formula 5's side of ``search._DP``: from one prefix (a DP state) and one placement of the new stage, every
    end of it that the bounds let through, priced, and the prefixes that enter the states of their ends (it
    provides the costs, the bounds, the memo and the cut)."""

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
        before = W + Bsum + f + bb
        x = before + self.period_rest(j2, n_rest, ts, hi, lo, before, nextafter(low, INF))  # (at most low: low)
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
