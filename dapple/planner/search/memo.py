"""The search's memo: planned-stage prefixes, a new stage's placements, state keys up to server symmetry."""

from __future__ import annotations

import gc
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

from ..model.cost import ServerLayout
from .placement import placements


@dataclass(slots=True)
class _Prefix:
    """Stages planned so far (layers [0, j)), in canonical server labels, with their interleaved costs (the
    communication stage after the last one is not included: it depends on the next stage)."""

    parent: "_Prefix | None"  # the prefix this one extends by one stage (None: no stage yet)
    span: tuple | None  # that stage, (a, c, layout) in the parent's server labels
    perm: list | None  # the parent's server labels -> this prefix's
    last: ServerLayout | None  # the last stage's layout in this prefix's labels
    depth: int  # stages planned
    policies: tuple  # placement policy of each stage
    F: list
    B: list
    AR: list
    E: list
    C: list  # B, with the gradients' share of a round trip for communication stages (refined model)
    D: list
    lb: float  # lower bound on L of any completion, from the fixed stages' steady costs
    free: tuple  # free devices per server (canonical order)
    latency: float | None  # formula 5: the complete plan prefix + the remaining layers as one stage on the free
    # devices (None until _DP.prefix_latency prices it from ``job``)
    servers: dict  # per server, (uplink, downlink) ms per micro-batch of the prefix's transfers (refined model)
    server_max: float
    dev: float  # busiest device link of the prefix per micro-batch (refined model)
    last_in: float  # busiest receiving device link of the prefix's last communication stage
    W: float = 0.0  # sum of the prefix's F (compute and communication): when the first micro-batch leaves it
    Bsum: float = 0.0  # sum of the prefix's B (communication: its round-trip share): the last gradient's way back
    below: float | None = None  # refined_chains' `below` after the last stage: its ending and what follows it
    fmax: float = 0.0  # slowest forward of the prefix (compute or communication)
    floor: float = 0.0  # the least L of any completion by the search's bounds when it was made (tighten() raises
    # the floors of prefixes made after it): the memo's rank
    Cw: list | None = None  # as C, the steady state's share (CostModel.comm_links' window)
    dev_drain: float = 0.0  # busiest device link of the prefix per micro-batch once activations stop (one way)
    queue: tuple = ()  # comm.queues of each stage before the last (the last's needs the next stage)
    hot: tuple = ()  # the last stage's inbound links that are the busiest of its transfer in (CostModel.comm_links)
    lead: tuple | None = None  # least `lead` and own chain terms of its stages in a plan of depth + 2 (_DP.prefix_lead)
    us: list | None = None  # _DP.prefix_u_table: the prefix's largest U per count of stages after it (on use)
    ts: dict | None = None  # _DP.period_ts's buckets but the last, per (stages after, links, buckets) (on use)
    users: dict = field(default_factory=dict)  # per server, the communication stages on its uplink and downlink
    # with their ms per micro-batch (comm.add_users; refined model)
    job: tuple | None = None  # with F, B, ..., what _DP.prefix_latency prices ``latency`` from

    def spans(self) -> tuple:
        """((a, c, layout), ...) in this prefix's labels (built on demand: most prefixes never need it)."""
        if self.parent is None:
            return ()
        perm = self.perm
        return tuple((a, c, tuple(perm[s] for s in lay)) for a, c, lay in self.parent.spans() + (self.span,))


class _Memo:
    """The memo's side of ``search._DP``: which prefixes a layer expands and the placements (state keys) a new
    stage can take (it provides the cluster's shape, b and the key tables)."""

    def frontier(self, layer_states: dict) -> list:
        """The prefixes to expand at one j: all of them (the exact DP)."""
        return [p for bucket in layer_states.values() for p in bucket]

    def options(self, free: tuple, prev: ServerLayout | None, m: int) -> list:
        """The distinct placements of a new stage of m replicas (memoised): policy, its layout, the free devices
        after it, the rest's device count and layout (its first b replicas when wider), the new state's key and
        server relabelling, whether it spans servers, and the communication costs in and out of it per cut
        (CostModel.comm_pair, filled by expand() once a placement passes the bounds: they depend on the previous
        stage's layout itself)."""
        key = (free, prev, m)
        hit = self._options.get(key)
        if hit is None:
            # the rest depends on the previous stage only through the order its servers first appear in
            hit = self._options[key] = [(*option, []) for option in
                                        self._placed(free, tuple(dict.fromkeys(prev)) if prev else (), m)]
        return hit

    def _placed(self, free: tuple, first_servers: tuple, m: int) -> list:
        """:meth:`options` but the communication costs, for a previous stage whose servers first appear in the
        order ``first_servers`` (memoised)."""
        key = (free, first_servers, m)
        hit = self._placements.get(key)
        if hit is None:
            first = {s: k for k, s in enumerate(first_servers)}
            order = sorted(range(self.ns), key=lambda s: (first.get(s, 1 << 30), s))
            hit = []
            for name, take in placements(free, self.dps, m, order):
                free2 = tuple(free[s] - take[s] for s in range(self.ns))
                kinds = {(x, t) for x, t in zip(free2, take) if 0 < x < self.dps}
                if self.partial_kinds is not None and len(kinds) > self.partial_kinds:
                    continue
                # replica order: like the previous stage (its slices meet theirs on the same server), or with
                # the servers that keep the most free devices first (the larger first slices meet the next
                # stage's there)
                ahead = sorted(range(self.ns), key=lambda s: (-free2[s], first.get(s, 1 << 30), s))
                rank = {s: r for r, s in enumerate(ahead)}
                like = _arrange(take, first_servers)
                for new in dict.fromkeys((like, tuple(sorted(like, key=rank.get)))):
                    n_rest = sum(free2)
                    wide = n_rest > self.b  # the rest cannot be one stage: rank the state as if it had b replicas
                    tail = _arrange(free2, new, self.b)
                    canon = self._canon.get((free2, new))
                    if canon is None:
                        state_key, perm = _canonical(free2, new)
                        kid = self._kid.setdefault(state_key, len(self._kid))  # an int: cheaper to hash than the key
                        canon = self._canon[(free2, new)] = (kid, perm)
                    kid, perm = canon
                    # the rest's layout only as far as a stage can use it (b replicas): on 128 x 8 a whole tail
                    # per placement filled gigabytes (a wide rest is never recorded as a plan's last stage)
                    hit.append((name, new, free2, n_rest, tail, wide, kid, perm, len(set(new)) > 1))
            self._placements[key] = hit
        return hit


@dataclass
class SearchResult:
    latency: float
    spans: tuple  # ((a, c, server of each replica), ...)
    policies: tuple  # how each stage was placed: fresh/append/scatter, "rest" (the last stage), "even" (a seed)
    warmup_policy: str
    micro_batch_size: int
    states: int
    transitions: int


def _arrange(take: Sequence[int], prev: ServerLayout | None, limit: int | None = None) -> ServerLayout:
    """Replicas of a stage taking ``take[s]`` devices of server s, ordered like the previous stage's servers
    (split-concat then pairs replicas on the same server where it can); with ``limit``, only the first ones."""
    first: dict = {}
    for k, s in enumerate(prev or ()):
        first.setdefault(s, k)
    servers = sorted((s for s in range(len(take)) if take[s] > 0), key=lambda s: (first.get(s, 1 << 30), s))
    out: list = []
    for s in servers:
        out += [s] * take[s]
        if limit is not None and len(out) >= limit:
            return tuple(out[:limit])
    return tuple(out)


def _canonical(free: Sequence[int], last: ServerLayout) -> tuple[bytes, list[int]]:
    """State key and relabelling: servers sorted by (free devices, replicas of the last stage on it). The
    paper memoises on the devices used (formula 4's (j, m, g)); up to server symmetry that is the multiset of
    free counts. The last stage's replica counts per server are added because they decide the split-concat
    routes to the next stage (where on a server the replicas sit in the stage's order is left out: merging
    those keeps the DP exact on every brute-force instance, tests/planner/test_search.py)."""
    count: dict = {}
    for x in last:
        count[x] = count.get(x, 0) + 1
    desc = [(free[s], count.get(s, 0)) for s in range(len(free))]
    order = sorted(range(len(free)), key=desc.__getitem__)
    perm = [0] * len(free)
    for new, old in enumerate(order):
        perm[old] = new
    # as bytes: on 128 servers a tuple of pairs took 8 kB per state, these 1 kB
    return array("I", [x for s in order for x in desc[s]]).tobytes(), perm


@contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector: the search allocates millions of short-lived lists and tuples, and
    the collector's full passes over the long-lived memo cost about 20% of the 8x8 search; what it keeps is
    acyclic (prefixes point to their parents), so reference counting frees it as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
