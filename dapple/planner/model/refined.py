"""The refined latency model: formula 2's pivot-stage chain plus the bubbles, link queues and overlap it ignores."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .pivot import Latency

INF = float("inf")


class ChainResult(NamedTuple):
    """The refined model's answer for one warmup choice (:func:`refined_chains`)."""

    total: float  # L, ms (only known to be >= the limit where a chain reached it)
    latency: Latency  # (Tw, Ts, Te, pivot) of the longest chain


def refined_latency(F: Sequence[float], B: Sequence[float], AR: Sequence[float], E: Sequence[float] | None,
                    K: Sequence[int], M: int, *, link_period: float | None = None,
                    chain: Sequence[float] | None = None, window: Sequence[float] | None = None,
                    drain_period: float | None = None, queue: Sequence[bool] | None = None,
                    feed: Sequence[float] | None = None) -> Latency:
    """Latency of the early-backward schedule over interleaved stages (compute 2i, communication 2i+1).

    Like formula 2, the latency is the chain of one pivot stage: the first micro-batch reaching it (Tw), its
    steady work (Ts), and the last gradient's way down with the AllReduces (Te). Unlike formula 2, every
    stage's chain is computed and the longest is the latency (its stage is the pivot), and each chain adds
    what formula 2 leaves out (each checked against :func:`dapple.planner.simulate`):

    - stage i holds K_i micro-batches: its first backward waits for the downstream round trip D_i, in which
      every stage j below waits for its own K_j-th forward before its first backward (``reach``), and its
      last K_i backwards for the last round trip (max(K_i B_i, D_i + B_i)); between them M-K_i pairs at
      max(F_i+B_i, RT_i/K_i) each (a window too small for the round trip RT_i = F_i + D_i + B_i leaves
      bubbles: why policy B helps);
    - the loop from stage i to a stage j below and back holds K_i - K_j + 1 micro-batches (j's backward of m
      follows its forward of m + K_j - 1, which needs i's forward of m + K_j - 1, which follows i's backward
      of m + K_j - 1 - K_i): the period is at least its F and B over that count (j = the last: RT_i/K_i);
    - forwards arrive at the rate of the slowest upstream forward while upstream warms up (its first
      K_{i-1}), then once per period of the stages from i-1 down, P_{i-1} (P_0 = P: the slowest resource of
      the whole pipeline, compute or link), and no closer than a stage j above releases them: after its first
      backward it alternates, one forward per P_j (K_j < M), or it runs all M forwards back to back;
    - a communication stage is a pivot candidate too: its M forward (and M backward) transfers queue on its
      busiest link, no faster than once per ``link_period`` (its link may carry other stages' transfers too);
      once the next stage has done its last forward, its last K_{i+1} - 1 gradient transfers go once per
      ``drain_period``;
    - stage i's first gradient from below may queue behind the activations stage i-1 posted before it
      (``queue``), and while everyone warms up a shared server link may slow activations down (``feed``);
    - with ``E`` (overlap), a stage's AllReduce runs bucket by bucket during its last backward;
    - stages after the pivot: their own chains, not formula 2's negative terms.

    Args:
        F, B: forward and backward ms per interleaved stage (a communication stage: its busiest link).
        AR: AllReduce ms per interleaved stage (0 for communication stages and single replicas).
        E: with overlap, ms from the start of a stage's last backward to the end of its AllReduce; None: no
            overlap (B + AR).
        K: warmup K_i per compute stage.
        M: micro-batches per iteration.
        link_period: the least ms per micro-batch the links allow in the steady phase
            (:meth:`CostModel.link_periods`); None: each communication stage's busiest link alone.
        chain: what each stage adds to a round trip on the gradients' way back (``CommLinks.chain`` for
            communication stages); default B.
        window: the same for the round trips that bound the steady state (``CommLinks.window``); default chain.
        drain_period: ``link_period`` once activations have stopped (gradients alone); default link_period.
        queue: per compute stage, whether its first gradient queues behind its activations
            (:func:`transfers.queues`).
        feed: per interleaved stage, the warmup's floor where server links carry several stages
            (:func:`transfers.feeds`).

    Returns:
        The :class:`Latency` of the longest chain; its ``pivot`` indexes the interleaved stages.
    """
    return refined_chains(F, B, AR, E, [K], M, link_period=link_period, chain=chain, window=window,
                          drain_period=drain_period, queue=queue, feed=feed)[0].latency


def refined_chains(F: Sequence[float], B: Sequence[float], AR: Sequence[float], E: Sequence[float] | None,
                   Ks: Sequence[Sequence[int]], M: int, *, link_period: float | None = None,
                   chain: Sequence[float] | None = None, limit: float = INF,
                   window: Sequence[float] | None = None, drain_period: float | None = None,
                   queue: Sequence[bool] | None = None, race: bool = False,
                   feed: Sequence[float] | None = None) -> list[ChainResult]:
    """:func:`refined_latency` for several warmup choices ``Ks`` at once (the costs are shared).

    Args:
        limit: once a stage's chain reaches it, the rest of that choice's stages are skipped (L is then only
            known to be >= limit: what the search needs to reject it).
        race: each choice after the first has the least L so far as its limit too (only the fastest is exact).
        Others: as :func:`refined_latency`.

    Returns:
        One :class:`ChainResult` per warmup choice, in order.
    """
    model = _Chains(F, B, AR, E, M, link_period=link_period, chain=chain, window=window, drain_period=drain_period,
                    feed=feed)
    out: list[ChainResult] = []
    for K in Ks:
        if race and out and out[-1].total < limit:
            limit = out[-1].total
        out.append(model.longest(K, queue, limit))
    return out


class _Chains:
    """What every warmup choice shares: the round trips, tails and warmup supply of one set of stage costs."""

    __slots__ = ("F", "B", "M", "S", "n", "per_link", "Bc", "lp", "ld", "down", "downw", "emax", "tail", "warms",
                 "supplies", "posts")

    def __init__(self, F: Sequence[float], B: Sequence[float], AR: Sequence[float], E: Sequence[float] | None,
                 M: int, *, link_period: float | None, chain: Sequence[float] | None,
                 window: Sequence[float] | None, drain_period: float | None, feed: Sequence[float] | None):
        self.F, self.B, self.M, self.S, self.n = F, B, M, len(F), (len(F) + 1) // 2
        self.per_link = link_period is None  # no plan-wide link period: each communication stage's own link
        self.Bc = Bc = B if chain is None else chain  # the gradients' way back, for round trips and endings
        self.lp = lp = link_period if link_period is not None else 0.0  # a transfer's queue moves at most this fast
        self.ld = drain_period if drain_period is not None else lp  # the same once activations have stopped
        self.down = _round_trips(F, Bc)  # down[a]: a round trip from stage a on
        Wd = Bc if window is None else window  # the round trips that bound the steady state (windows, loops)
        self.downw = self.down if Wd is Bc or Wd == Bc else _round_trips(F, Wd)
        self.emax = _largest_from(F, Wd)
        self.tail = _tails(B, AR, E, Bc, self.n)
        self.warms, self.supplies, self.posts = _warmup_supply(F, feed)

    def longest(self, K: Sequence[int], queue: Sequence[bool] | None, limit: float) -> ChainResult:
        """The longest stage chain for warmup ``K`` (stopping once one reaches ``limit``)."""
        pace = self.paces(K)
        reach = self.reaches(K, queue)
        lead = self.leads(K, reach, pace)
        S = self.S
        warms = self.warms
        # with a limit, the last stage first: its chain is nearly always the longest, so a plan the search rejects
        # is rejected there (ties still go to the first stage in order, as without a limit)
        order = range(S) if limit == INF else [S - 1, *range(S - 1)]
        compute_chain, comm_chain = self.compute_chain, self.comm_chain
        best_total, best = -1.0, (0.0, 0.0, 0.0, S)  # (Tw, Ts, Te, pivot)
        for a in order:
            if not a & 1:
                first, steady, last, end_tail = compute_chain(a, K, pace, reach, lead)
            else:
                first, steady, last, end_tail = comm_chain(a, K, reach)
            warm = warms[a]
            total = warm + first + steady + last + end_tail
            if total > best_total or (total == best_total and a < best[3]):
                best_total, best = total, (warm + first, steady, last + end_tail, a)
                if total >= limit:
                    break
        return ChainResult(best_total, Latency(*best))

    def paces(self, K: Sequence[int]) -> list[float]:
        """pace[i]: the period of stages i and below alone: their F + B, windows and loops, and the links
        (``link_period``, or without it each communication stage's busiest link, each direction apart);
        pace[0] is the plan's period P."""
        F, B, M, n, downw, emax, per_link = self.F, self.B, self.M, self.n, self.downw, self.emax, self.per_link
        pace = [0.0] * n
        period = self.lp
        # steep[i]: K falls by at least 2 a stage from i to the last but one, so each loop from i holds at least
        # as many micro-batches as it has stages (2 (j - i) + 1, compute and communication): its F + B over that
        # count is an average, at most emax[2 i] (the loop is skipped then: the same L to the last bit)
        steep = [True] * n
        for i in range(n - 3, -1, -1):
            steep[i] = steep[i + 1] and K[i] - K[i + 1] >= 2
        for i in range(n - 1, -1, -1):
            a = 2 * i
            x = F[a] + B[a]
            if x > period:
                period = x
            if per_link and i < n - 1:
                x = F[a + 1] if F[a + 1] > B[a + 1] else B[a + 1]
                if x > period:
                    period = x
            k = K[i]
            if k < M:  # window: K_i micro-batches per round trip, once the stage alternates
                x = downw[2 * i] / (k if k > 1 else 1)
                if x > period:
                    period = x
                # the loop from stage i to stage j and back holds K_i - K_j + 1 (j = the last: the line above)
                for j in range(i + 1, n - 1 if not steep[i] or emax[a] * (1 + 1e-9) > period else 0):  # (rounding)
                    t = k - K[j] + 1
                    x = (downw[2 * i] - downw[2 * j + 1]) / (t if t > 1 else 1)
                    if x > period:
                        period = x
            pace[i] = period
        return pace

    def reaches(self, K: Sequence[int], queue: Sequence[bool] | None) -> list[float]:
        """reach[i]: when stage i's first backward can start, from 0 = the first forward upstream: after its K_i-th
        forward arrives, and after the first gradients come back, which wait for the warmups below it."""
        F, B, Bc, M, n = self.F, self.B, self.Bc, self.M, self.n
        warms, supplies, posts = self.warms, self.supplies, self.posts
        reach = [0.0] * n
        for i in range(n - 1, -1, -1):
            a = 2 * i
            k = K[i] if K[i] < M else M
            x = warms[a] + F[a] + ((k if k > 1 else 1) - 1) * supplies[a]
            if i < n - 1:
                y = reach[i + 1] + B[a + 2] + Bc[a + 1]
                if i and queue is not None and queue[i]:  # behind the activations stage i-1 posted before it
                    up = K[i - 1] if K[i - 1] < M else M  # it posts up to K_{i-1}, one per slowest forward so far
                    sp = posts[a - 2]
                    posted = int((y - Bc[a + 1] - warms[a - 1]) / sp) + 1 if sp > 0 else up
                    posted = up if posted > up else (posted if posted > 1 else 1)
                    z = warms[a] + (posted - 1) * supplies[a - 1] + Bc[a + 1]  # landed one per supply
                    if z > y:
                        y = z
                if y > x:
                    x = y
            reach[i] = x
        return reach

    def leads(self, K: Sequence[int], reach: list[float], pace: list[float]) -> list[float]:
        """lead[i]: the longest time from first to last forward of a stage above i (its forwards reach stage i as
        far apart): one that alternates (K_j < M) runs its last M-1-K_j forwards one per pace[j] after its
        first backward; one that holds every micro-batch (K_j >= M) back to back, as the forwards reach it."""
        B, M, n, warms, supplies = self.B, self.M, self.n, self.warms, self.supplies
        lead = [0.0] * n
        x = 0.0
        for j in range(n - 1):
            k = K[j]
            y = reach[j] - warms[2 * j] + B[2 * j] + (M - 1 - k) * pace[j] if k < M else (M - 1) * supplies[2 * j]
            if y > x:
                x = y
            lead[j + 1] = x
        return lead

    def compute_chain(self, a: int, K: Sequence[int], pace: list[float], reach: list[float],
                      lead: list[float]) -> tuple[float, float, float, float]:
        """(first, steady, last, tail) ms of compute stage ``a``'s chain after its warmup: k forwards, the first
        backward after the round trip, M-k pairs, k backwards, then what follows below it."""
        M, i, f, b = self.M, a >> 1, self.F[a], self.B[a]
        k = K[i] if K[i] < M else M
        if k < 1:
            k = 1
        d = self.down[a] - f - self.Bc[a]  # downstream round trip of one micro-batch
        if i == 0:
            arrive = 0.0
        else:
            up = K[i - 1] if K[i - 1] < M else M
            up = up if up > 1 else 1
            arrive = (min(M - 1, up - 1)) * self.supplies[a] + (M - up) * pace[i - 1]
            if lead[i] > arrive:
                arrive = lead[i]
        r0 = reach[i] - self.warms[a]  # from this stage's first forward to its first backward
        if M <= k:  # every forward before the first backward (gpipe, or few micro-batches)
            first = f
            steady = 0.0
            last = max(M * (f + b), r0 + M * b, arrive + f + d + b, M * f + d + b) - f
        else:
            first = r0
            pair = self.downw[a] / k
            if f + b > pair:
                pair = f + b
            steady = (M - k) * pair
            if arrive + f - first > steady:
                steady = arrive + f - first
            last = k * b if k * b > d + b else d + b
        return first, steady, last, self.tail[i]

    def comm_chain(self, a: int, K: Sequence[int], reach: list[float]) -> tuple[float, float, float, float]:
        """(first, steady, last, tail) ms of communication stage ``a``'s chain: M transfers each way queue on its
        busiest link, then the last round trip and the backward of the stage above it."""
        F, B, Bc, M, lp, ld, i = self.F, self.B, self.Bc, self.M, self.lp, self.ld, a >> 1
        f = F[a]
        d = self.down[a + 1]  # round trip from the next compute stage on
        stagger = f - Bc[a] if f > Bc[a] else 0.0  # the first receiver's data lands this much earlier
        rate = f if f > lp else lp
        fwd = (M - 1) * rate + d + Bc[a]  # the last activations, then the last round trip
        # the first gradients leave when the next stage has done its first backward (``reach``: after its K
        # forwards and the round trip below it, so at least d after the first transfer)
        g = reach[i + 1] + B[a + 1] - self.warms[a + 1]
        # M - K_{i+1} of them while activations still flow, the last K_{i+1} - 1 gradients alone
        kn = K[i + 1] if K[i + 1] < M else M
        bwd = (g - stagger + (M - kn) * (B[a] if B[a] > lp else lp) + (kn - 1) * (B[a] if B[a] > ld else ld)
               + B[a])
        steady = (M - 1) * rate if fwd >= bwd else bwd - d - Bc[a]
        return f, steady, d + Bc[a], B[2 * i] + self.tail[i]


def _round_trips(F: Sequence[float], back: Sequence[float]) -> list[float]:
    """out[a] = sum_{a' >= a} (F + back): one micro-batch's round trip from stage a on (out[S] = 0)."""
    out = [0.0] * (len(F) + 1)
    acc = 0.0
    for a in range(len(F) - 1, -1, -1):
        acc += F[a] + back[a]
        out[a] = acc
    return out


def _largest_from(F: Sequence[float], back: Sequence[float]) -> list[float]:
    """out[a]: the largest F + back of a stage from a on (bounds a loop's average)."""
    out = [0.0] * (len(F) + 1)
    x = 0.0
    for a in range(len(F) - 1, -1, -1):
        y = F[a] + back[a]
        if y > x:
            x = y
        out[a] = x
    return out


def _tails(B: Sequence[float], AR: Sequence[float], E: Sequence[float] | None, Bc: Sequence[float],
           n: int) -> list[float]:
    """tail[i]: from the end of stage i's last backward to the end of the iteration below it (formula 2's Te)."""
    tail = [0.0] * n
    below = None  # max over s < i of (own_s + the B between s's end and stage i)
    for i in range(n):
        b = B[2 * i]
        own = b + AR[2 * i] if E is None else E[2 * i]  # last backward + AllReduce (overlapped: E)
        if below is not None:
            below += Bc[2 * i - 1]
            tail[i] = below if below > own - b else own - b
            below = below + b if below + b > own else own
        else:
            tail[i] = own - b
            below = own
    return tail


def _warmup_supply(F: Sequence[float], feed: Sequence[float] | None) -> tuple[list, list, list]:
    """(warms, supplies, posts) per stage: the sum of F before it; the slowest forward up to it, floored by
    ``feed`` (how fast forwards arrive while everyone warms up); the same without ``feed`` (how fast a stage
    posts its activations)."""
    S = len(F)
    warms, supplies = [0.0] * S, [0.0] * S
    acc = supply = post = 0.0
    posts = supplies if feed is None else [0.0] * S
    for a in range(S):
        warms[a] = acc
        if F[a] > supply:
            supply = F[a]
        if feed is not None:
            if F[a] > post:
                post = F[a]
            posts[a] = post
            if feed[a] > supply:
                supply = feed[a]
        supplies[a] = supply
        acc += F[a]
    return warms, supplies, posts
