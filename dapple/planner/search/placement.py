"""Device placement policies of paper IV-B (Fig. 5): Fresh First, Append First, Scatter First."""

from __future__ import annotations

from typing import Callable, Sequence

from ..model.cost import ServerLayout

Take = list  # devices to take from each server, indexed like the free counts


def _order(n: int, order: Sequence[int] | None) -> list[int]:
    return list(order) if order is not None else list(range(n))


def _fill(free: Sequence[int], need: int, servers: Sequence[int], take: list[int]) -> int:
    """Take devices server by server (as many as each has) until ``need`` is met; returns what is left."""
    for s in servers:
        if need <= 0:
            break
        k = min(free[s] - take[s], need)
        take[s] += k
        need -= k
    return need


def fresh_first(free: Sequence[int], per_server: int, need: int, order: Sequence[int] | None = None) -> Take | None:
    """Fresh First: whole unused servers first (a stage tends to sit on one server's fast links); only
    when the fresh servers cannot hold the stage, the rest comes from partly used servers (most free first)."""
    if need < 1 or need > sum(free):
        return None
    srv = _order(len(free), order)
    take = [0] * len(free)
    need = _fill(free, need, [s for s in srv if free[s] == per_server], take)
    need = _fill(free, need, sorted((s for s in srv if 0 < free[s] < per_server), key=lambda s: -free[s]), take)
    return take if need == 0 else None


def append_first(free: Sequence[int], per_server: int, need: int, order: Sequence[int] | None = None) -> Take | None:
    """Append First: servers that already have devices taken first (less fragmentation): the one whose free
    devices fit the stage most tightly if one can hold it all, else the most free first; then fresh servers."""
    if need < 1 or need > sum(free):
        return None
    srv = _order(len(free), order)
    used = [s for s in srv if 0 < free[s] < per_server]
    take = [0] * len(free)
    fits = [s for s in used if free[s] >= need]
    if fits:
        take[min(fits, key=lambda s: free[s])] = need  # min() keeps the first in `order` among ties
        return take
    need = _fill(free, need, sorted(used, key=lambda s: -free[s]), take)
    need = _fill(free, need, [s for s in srv if free[s] == per_server], take)
    return take if need == 0 else None


def scatter_first(free: Sequence[int], per_server: int, need: int, order: Sequence[int] | None = None) -> Take | None:
    """Scatter First: one device at a time, round robin over the used servers (over all servers when all are
    fresh), so the stage spreads evenly; when those run out, over every server with free devices."""
    if need < 1 or need > sum(free):
        return None
    srv = _order(len(free), order)
    used = [s for s in srv if 0 < free[s] < per_server]
    take = [0] * len(free)
    for group in (used or [s for s in srv if free[s] > 0], [s for s in srv if free[s] > 0]):
        while need > 0:
            progressed = False
            for s in group:
                if need > 0 and take[s] < free[s]:
                    take[s] += 1
                    need -= 1
                    progressed = True
            if not progressed:
                break
    return take if need == 0 else None


POLICIES: dict[str, Callable[..., Take | None]] = {
    "fresh": fresh_first, "append": append_first, "scatter": scatter_first}


def placements(free: Sequence[int], per_server: int, need: int,
               order: Sequence[int] | None = None) -> list[tuple[str, Take]]:
    """The distinct placements the three policies give for a stage of ``need`` devices: (policy, take)."""
    out, seen = [], set()
    for name, policy in POLICIES.items():
        take = policy(free, per_server, need, order)
        if take is not None and tuple(take) not in seen:
            seen.add(tuple(take))
            out.append((name, take))
    return out


def arrange(take: Sequence[int], prev: ServerLayout | None, limit: int | None = None) -> ServerLayout:
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
