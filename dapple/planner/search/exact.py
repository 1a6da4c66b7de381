"""Certificates: every plan of a small instance below a bar, enumerated (the proof behind "the model's best")."""

from __future__ import annotations

import time
from itertools import combinations
from math import comb, factorial
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from ...core.schedule import warmup_counts
from .. import tuning
from ..model.cost import Span
from ..model.evaluate import pipeline_costs
from .bound_tables import allreduce_floor
from .records import INF, Best, Found, SearchConfig

if TYPE_CHECKING:
    from ..model.cost import CostModel


class Split(NamedTuple):
    """Layer bounds and replicas per stage, with the least L any plan of them can have (:func:`split_floor`)."""

    floor: float
    bounds: tuple
    counts: tuple


def layout_count(servers: int, per_server: int) -> int:
    """How many ways to order every device of the cluster as server labels, once per relabelling of the
    servers (all alike): G! / (per_server!^servers x servers!)."""
    return factorial(servers * per_server) // (factorial(per_server) ** servers * factorial(servers))


def plan_count(layers: int, servers: int, per_server: int, micro: int, max_stages: int | None) -> int:
    """How many plans of one micro-batch size use every device: stage splits x replicas per stage (at most
    ``micro`` each) x :func:`layout_count` server layouts."""
    G = servers * per_server
    depth = min(layers, G) if max_stages is None else min(layers, G, max_stages)
    ways = [1] + [0] * G  # ways[n]: n devices as S stages of 1..micro replicas, S = 0, 1, ... in turn
    total = 0
    for S in range(1, depth + 1):
        run, nxt = 0, [0] * (G + 1)  # run: ways[n - micro .. n - 1] summed
        for n in range(G + 1):
            nxt[n] = run
            run += ways[n] - (ways[n - micro] if n >= micro else 0)
        ways = nxt
        total += comb(layers - 1, S - 1) * ways[G]
    return total * layout_count(servers, per_server)


class Layouts:
    """The one enumerator of device assignments (the certificates' Walk and baselines.exhaustive use it): every
    sequence of servers a stage of r replicas can take from the free devices per server, servers numbered by first
    appearance (each relabelling of the servers once; ``opened``: how many are numbered so far; opened = servers:
    every labelled sequence). Memoised; each entry is (layout, free after it, opened after it)."""

    def __init__(self, servers: int):
        self.servers = servers
        self._memo: dict = {}  # (replicas, free per server, servers opened) -> [(layout, free, opened)]

    def __call__(self, r: int, free: tuple, opened: int) -> list:
        key = (r, free, opened)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = []
            if r == 0:
                hit.append(((), free, opened))
            else:
                for s in range(min(opened + 1, self.servers)):  # a numbered server, or the next fresh one
                    if free[s]:
                        less = free[:s] + (free[s] - 1,) + free[s + 1:]
                        for lay, left, op in self(r - 1, less, max(opened, s + 1)):
                            hit.append(((s,) + lay, left, op))
        return hit

    def assignments(self, counts: tuple, per_server: int, labelled: bool = False) -> Iterator[tuple]:
        """Every way stages of ``counts`` replicas take all the devices, as server layouts, stage by stage
        (``labelled``: every labelling of the servers, not once per relabelling)."""
        opened = self.servers if labelled else 0
        partial: list[tuple[tuple, tuple, int]] = [((), (per_server,) * self.servers, opened)]
        for r in counts:
            partial = [(lays + (lay,), left, op) for lays, free, o in partial for lay, left, op in self(r, free, o)]
        return (lays for lays, _, _ in partial)


def server_sequences(servers: int, per_server: int) -> Iterator[tuple[int, ...]]:
    """Every sequence of server labels that uses each server's devices once, servers numbered by first
    appearance (each relabelling class once; :func:`layout_count` of them)."""
    return (lays[0] for lays in Layouts(servers).assignments((servers * per_server,), per_server))


def compositions(total: int, parts: int, most: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive terms of at most ``most``, in order."""
    if parts == 1:
        if 1 <= total <= most:
            yield (total,)
        return
    for first in range(1, min(most, total - parts + 1) + 1):
        for rest in compositions(total - first, parts - 1, most):
            yield (first,) + rest


class FloorTerms:
    """:func:`split_floor`'s terms of each stage and transfer, memoised (a split shares them with many others)."""

    def __init__(self, cm: "CostModel", config: SearchConfig):
        self.cm, self.config = cm, config
        self.stages: dict = {}  # (a, c, replicas) -> (F, B, least AllReduce part) or None: does not fit
        self.comms: dict = {}  # (c, senders, receivers) -> comm_floor

    def stage(self, a: int, c: int, r: int) -> tuple | None:
        key = (a, c, r)
        if key not in self.stages:
            cm, config = self.cm, self.config
            if cm.fits(a, c, r) < 1:  # (a recomputing stage holds its inputs too)
                self.stages[key] = None
            else:
                f, b = cm.compute(a, c, r)
                ar = float(allreduce_floor(cm, r, np.asarray([cm.params(a, c)]))[0]) if r > 1 else 0.0
                self.stages[key] = (f, b, max(ar - b, 0.0) if config.overlap else ar)
        return self.stages[key]

    def comm(self, c: int, r1: int, r2: int) -> float:
        key = (c, r1, r2)
        hit = self.comms.get(key)
        if hit is None:
            hit = self.comms[key] = comm_floor(self.cm, c - 1, r1, r2)
        return hit


def split_floor(terms: FloorTerms, M: int, bounds: tuple, counts: tuple) -> float:
    """A lower bound on L of every plan with these stages, whatever their servers (INF: a stage does not fit in
    device memory): the rest bound's terms (docs/planner.md, "The bounds") with each transfer as if both stages sat
    on one server (:func:`comm_floor`) and each AllReduce on its cheapest ring, since neither can be cheaper."""
    out = w = bsum = 0.0  # (refined) the first micro-batch's forwards before s; the last one's backwards
    refined = terms.config.refined
    for s, r in enumerate(counts):
        c = bounds[s + 1]
        st = terms.stage(bounds[s], c, r)
        if st is None:
            return INF
        f, b, arp = st
        own = M * (f + b) + (w + max(bsum, arp) if refined else 0.0)
        if own > out:
            out = own
        if s + 1 < len(counts):
            t = terms.comm(c, r, counts[s + 1])
            own = w + f + M * t + bsum + b if refined else 2 * M * t
            if own > out:
                out = own
            w, bsum = w + f + t, bsum + b
    return out


def comm_floor(cm: "CostModel", layer: int, senders: int, receivers: int) -> float:
    """The least ms a transfer after ``layer`` from ``senders`` to ``receivers`` replicas can take: every route
    within one server (0 where a link between servers could be faster than one inside)."""
    cl = cm.cluster
    if cl.inter_bandwidth > cl.intra_bandwidth or cl.inter_latency < cl.intra_latency:
        return 0.0
    return cm.comm_pair((0,) * senders, (0,) * receivers)(layer).busiest


def splits(cm: "CostModel", M: int, config: SearchConfig, bar: float) -> list[Split]:
    """Every stage split x replicas per stage that uses all devices and whose floor is below ``bar``, lowest
    floor first."""
    N, G, b = cm.num_layers, cm.cluster.num_devices, cm.micro
    depth = min(N, G) if config.max_stages is None else min(N, G, config.max_stages)
    terms = FloorTerms(cm, config)
    out = []
    for S in range(1, depth + 1):
        every = list(compositions(G, S, b))
        for cuts in combinations(range(1, N), S - 1):
            bounds = (0,) + cuts + (N,)
            for counts in every:
                floor = split_floor(terms, M, bounds, counts)
                if floor < bar:
                    out.append(Split(floor, bounds, counts))
    out.sort()
    return out


class Partial(NamedTuple):
    """A plan walked up to some stage: its stages, the devices left per server, the servers numbered so far, and
    (refined model) the first micro-batch's forwards and the last one's backwards before the next stage."""

    spans: tuple
    free: tuple
    opened: int
    forwards: float
    backwards: float


class Walk:
    """The plans of one micro-batch size, stage by stage: each stage's replicas on every sequence of servers the
    devices left allow (:class:`Layouts`), a partial plan dropped as soon as its transfers and AllReduces (with
    their servers) put it at or above the bar (:func:`split_floor`'s terms); the plans that get through are
    priced."""

    def __init__(self, cm: "CostModel", M: int, config: SearchConfig, bar: float):
        self.cm, self.M, self.config, self.bar = cm, M, config, bar
        self.servers, self.per_server = cm.cluster.servers, cm.cluster.devices_per_server
        self.policies = ((config.warmup_policy,) if config.warmup_policy else ("A", "B")) if config.refined \
            else ("A",)
        self.best = Best(INF, None)
        self.kept: list | None = None  # every plan priced, (L, spans, warmup policy) (priced_plans), or None
        self.layouts = Layouts(self.servers)
        self._comm: dict = {}  # (layout, next layout, end) -> the transfer's busiest link ms
        self._ar: dict = {}  # (a, c, layout) -> AllReduce ms

    @property
    def below(self) -> float:
        """What a plan must stay below: the bar, or the best plan found if lower (every plan: the bar)."""
        return self.bar if self.kept is not None or self.bar < self.best.latency else self.best.latency

    def split(self, bounds: tuple, counts: tuple) -> None:
        """Every plan of these stages below the bar; the best kept."""
        self._stage(bounds, counts, Partial((), (self.per_server,) * self.servers, 0, 0.0, 0.0))

    def _stage(self, bounds: tuple, counts: tuple, done: Partial) -> None:
        """Stage len(done.spans) of the split on every layout ``done`` leaves it, each completed (recursively)."""
        cm, M, refined = self.cm, self.M, self.config.refined
        spans, w, bsum = done.spans, done.forwards, done.backwards
        s = len(spans)
        a, c = bounds[s], bounds[s + 1]
        f, b = cm.compute(a, c, counts[s])
        prev = spans[-1][2] if spans else None
        for lay, left, op in self.layouts(counts[s], done.free, done.opened):
            low, w2, bsum2 = 0.0, w, bsum
            if prev is not None:
                pa = spans[-1]
                t = self._transfer(prev, lay, pa[1])
                fp, bp = cm.compute(pa[0], pa[1], len(prev))
                low = w + fp + M * t + bsum + bp if refined else 2 * M * t
                w2, bsum2 = w + fp + t, bsum + bp
            if refined:
                ar = self._allreduce(a, c, lay)
                low = max(low, w2 + M * (f + b) + max(bsum2, max(ar - b, 0.0) if self.config.overlap else ar))
            if low >= self.below:
                continue
            here = spans + (Span(a, c, lay),)
            if s + 1 < len(counts):
                self._stage(bounds, counts, Partial(here, left, op, w2, bsum2))
            else:
                self._price(here)

    def _transfer(self, src: tuple, dst: tuple, c: int) -> float:
        key = (src, dst, c)
        hit = self._comm.get(key)
        if hit is None:
            hit = self._comm[key] = self.cm.comm_pair(src, dst)(c - 1).busiest
        return hit

    def _allreduce(self, a: int, c: int, lay: tuple) -> float:
        key = (a, c, lay)
        hit = self._ar.get(key)
        if hit is None:
            hit = self._ar[key] = self.cm.allreduce(a, c, lay)
        return hit

    def _price(self, spans: tuple) -> None:
        """The plan's L under the model (each warmup policy the search prices); the best kept."""
        config, M = self.config, self.M
        pc, D = pipeline_costs(self.cm, spans, M, "A", check=False, endings=config.overlap)
        least = None
        for pol in self.policies:
            pc.K = warmup_counts(len(spans), M, pol, max_in_flight=D)
            t = pc.latency(config.model, config.overlap).total
            if t < self.best.latency:
                self.best = Best(t, Found(spans, ("enumerated",) * len(spans), pol))
            if least is None or t < least[0]:
                least = (t, spans, pol)
        if self.kept is not None:
            self.kept.append(least)


def exact_search(cm: "CostModel", M: int, config: SearchConfig, bar: float = INF, limit: int | None = None,
                 deadline: float | None = None) -> Best | None:
    """The best plan of one micro-batch size below ``bar`` over every stage split x every assignment of all
    devices (each stage's replicas in every order, as server layouts), by enumeration: splits whose floor
    (:func:`split_floor`) reaches the bar, lowered by each better plan found, are never walked, nor partial plans
    whose own transfers and AllReduces reach it (:class:`Walk`).

    Args:
        cm: the cost model (profile, cluster, micro-batch size).
        M: micro-batches per iteration.
        config: the model, overlap, warmup policy and max_stages searched (SearchConfig).
        bar: only plans below this are of interest.
        limit: enumerate only instances of at most this many plans (:func:`plan_count`; None:
            SearchTuning.exact_plans; above it the DP's space is all that was searched).
        deadline: a time.perf_counter() value past which it gives up (returns None).

    Returns:
        The best plan below ``bar`` (latency INF: none; its stages' policies "enumerated"), or None when the
        enumeration would exceed ``limit`` or ``deadline``.
    """
    cl = cm.cluster
    limit = tuning.TUNING.exact_plans if limit is None else limit
    if plan_count(cm.num_layers, cl.servers, cl.devices_per_server, cm.micro, config.max_stages) > limit:
        return None
    todo = splits(cm, M, config, bar)
    walk = Walk(cm, M, config, bar)
    for floor, bounds, counts in todo:
        if floor >= walk.below:
            break  # (sorted: so are all after it)
        if deadline is not None and time.perf_counter() > deadline:
            return None
        walk.split(bounds, counts)
    return walk.best


def priced_plans(cm: "CostModel", M: int, config: SearchConfig) -> list[tuple[float, tuple, str]]:
    """Every plan of one micro-batch size that fits in memory, as (its L under the model with the better warmup
    policy, spans, that policy), lowest first (for instances of a few hundred plans: plan_count)."""
    walk = Walk(cm, M, config, INF)
    walk.kept = []
    for _, bounds, counts in splits(cm, M, config, INF):
        walk.split(bounds, counts)
    return sorted(walk.kept, key=lambda k: k[0])
