"""The search's memo: planned-stage prefixes, a new stage's placements, state keys up to server symmetry."""

from __future__ import annotations

import gc
from array import array
from contextlib import contextmanager
from typing import Sequence

from ..model.cost import ServerLayout
from .placement import arrange, placements
from .records import Option

# Option's fields but the communication costs: policy, new, free, n_rest, tail, wide, key, perm, multi
Placed = tuple[str, ServerLayout, tuple, int, ServerLayout, bool, int, list, bool]


class Memo:
    """Which prefixes a layer expands and the placements (state keys) a new stage can take, for a cluster of
    ``servers`` x ``per_server`` devices and micro-batches of ``micro`` rows."""

    def __init__(self, servers: int, per_server: int, micro: int, partial_kinds: int | None):
        self.ns, self.dps, self.b, self.partial_kinds = servers, per_server, micro, partial_kinds
        self.listed: dict = {}  # (free, previous layout, m) -> options
        self._placements: dict = {}  # (free, the previous layout's servers in order, m) -> placed
        self._kid: dict = {}  # state key -> int id (the states are keyed by the id)
        self._canon: dict = {}  # (free devices, new stage's layout) -> (state key id, server relabelling)

    @staticmethod
    def frontier(layer_states: dict) -> list:
        """The prefixes to expand at one j: all of them (the exact DP)."""
        return [p for bucket in layer_states.values() for p in bucket]

    def forget(self) -> None:
        """Drop the memoised options and placements (recomputed on use: a long search bounds its memory)."""
        self.listed.clear()
        self._placements.clear()

    def known(self, free: tuple, prev: ServerLayout | None, m: int) -> list | None:
        """:meth:`options` if they were listed before, else None (not listing them)."""
        return self.listed.get((free, prev, m))

    def options(self, free: tuple, prev: ServerLayout | None, m: int) -> list:
        """The distinct placements of a new stage of m replicas after a stage on ``prev`` (memoised), their
        communication costs unfilled (Option.comms: they depend on the previous stage's layout itself)."""
        key = (free, prev, m)
        hit = self.listed.get(key)
        if hit is None:
            # the rest depends on the previous stage only through the order its servers first appear in
            hit = self.listed[key] = [Option(*placed, []) for placed in
                                        self.placed(free, tuple(dict.fromkeys(prev)) if prev else (), m)]
        return hit

    def placed(self, free: tuple, first_servers: tuple, m: int) -> list[Placed]:
        """:meth:`options` but the communication costs, for a previous stage whose servers first appear in the
        order ``first_servers`` (memoised)."""
        key = (free, first_servers, m)
        hit = self._placements.get(key)
        if hit is None:
            hit = self._placements[key] = self._place(free, first_servers, m)
        return hit

    def _place(self, free: tuple, first_servers: tuple, m: int) -> list[Placed]:
        first = {s: k for k, s in enumerate(first_servers)}
        order = sorted(range(self.ns), key=lambda s: (first.get(s, 1 << 30), s))
        out = []
        for name, take in placements(free, self.dps, m, order):
            free2 = tuple(free[s] - take[s] for s in range(self.ns))
            kinds = {(x, t) for x, t in zip(free2, take) if 0 < x < self.dps}
            if self.partial_kinds is not None and len(kinds) > self.partial_kinds:
                continue
            # replica order: like the previous stage (its slices meet theirs on the same server), or with the
            # servers that keep the most free devices first (the larger first slices meet the next stage's there)
            ahead = sorted(range(self.ns), key=lambda s: (-free2[s], first.get(s, 1 << 30), s))
            rank = {s: r for r, s in enumerate(ahead)}
            like = arrange(take, first_servers)
            for new in dict.fromkeys((like, tuple(sorted(like, key=rank.__getitem__)))):  # like: servers in rank
                out.append(self._option(name, new, free2))
        return out

    def _option(self, name: str, new: ServerLayout, free2: tuple) -> Placed:
        """Option's fields but the communication costs, for a new stage on ``new`` leaving ``free2``."""
        n_rest = sum(free2)
        wide = n_rest > self.b  # the rest cannot be one stage: rank the state as if it had b replicas
        # the rest's layout only as far as a stage can use it (b replicas): on many servers a whole tail per
        # placement filled gigabytes (a wide rest is never recorded as a plan's last stage)
        tail = arrange(free2, new, self.b)
        canon = self._canon.get((free2, new))
        if canon is None:
            state_key, perm = _canonical(free2, new)
            kid = self._kid.setdefault(state_key, len(self._kid))  # an int: cheaper to hash than the key
            canon = self._canon[(free2, new)] = (kid, perm)
        kid, perm = canon
        return (name, new, free2, n_rest, tail, wide, kid, perm, len(set(new)) > 1)


def _canonical(free: Sequence[int], last: ServerLayout) -> tuple[bytes, list[int]]:
    """State key and relabelling: servers sorted by (free devices, replicas of the last stage on it): the paper's
    devices used, up to server symmetry, and the last stage's replicas per server, which decide the routes to the
    next stage (docs/planner.md, "Formulas 4 and 5")."""
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
def gc_paused():
    """Pause the cyclic garbage collector: the search allocates millions of short-lived lists and tuples, and
    the collector's full passes over the long-lived memo would cost a large share of a search; what it keeps is
    acyclic (prefixes point to their parents), so reference counting frees it as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
