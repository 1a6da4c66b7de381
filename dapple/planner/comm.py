"""Communication-stage costs (paper IV-A): split-concat routes over the links of ``Cluster.graph()``."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .slices import Route


def comm_tables(rs: Sequence[Route], src: tuple, dst: tuple, route_times: Callable[[int, bool], np.ndarray],
                shared: bool = False) -> tuple:
    """``CostModel.comm_links`` at every cut of the model at once, for routes ``rs`` from replicas on servers
    ``src`` to replicas on servers ``dst``: (busiest, out, in, ((server, up + down), ...), chain), each an (N,)
    array over cuts. numpy over layers: the routes and links of two layouts are the same at every cut, only
    the bytes differ. ``route_times(rows, same_server)``: (N,) ms of
    one route at every cut; ``shared``: ``Cluster.link_sharing == "shared"``."""
    # each link's load is a count of route kinds (rows, same server): loads = counts @ times
    kinds: dict = {}  # (rows, same server) -> row of `times`
    links: dict = {}  # link -> {kind: routes}
    for r in rs:
        a, b = src[r.src], dst[r.dst]
        kind = kinds.setdefault((r.rows, a == b), len(kinds))
        for link in route_links(("send", r.src), ("recv", r.dst), a, b):
            c = links.setdefault(link, {})
            c[kind] = c.get(kind, 0) + 1
    times = np.stack([route_times(rows, same) for rows, same in kinds])  # (kinds, N) ms
    names = list(links)
    counts = np.zeros((len(names), len(kinds)))
    for x, link in enumerate(names):
        for kind, n in links[link].items():
            counts[x, kind] = n
    loads = counts @ times  # (links, N): ms each link is busy per micro-batch at each cut
    zero = np.zeros(times.shape[1])

    def most(which: tuple) -> np.ndarray:
        rows = [x for x, (k, _) in enumerate(names) if k in which]
        return loads[rows].max(axis=0) if rows else zero

    out, inc = most(("out", "xout")), most(("in", "xin"))
    row = {link: x for x, link in enumerate(names)}
    servers = sorted({who for (k, who) in names if k in ("up", "down")})
    ud = [(s, sum((loads[row[(k, s)]] for k in ("up", "down") if (k, s) in row), zero)) for s in servers]
    busiest = loads.max(axis=0)
    # one micro-batch alone: routes in posting order, each when its links are free; a receiver may
    # start when its last route lands. Its gradients can start back before the others' data is in.
    free: dict = {}
    done: dict = {}
    longest = zero
    for r in rs:
        a, b = src[r.src], dst[r.dst]
        t = times[kinds[(r.rows, a == b)]]
        longest = np.maximum(longest, t)
        end = zero
        ls = route_links(r.src, r.dst, a, b)
        for x in ls:
            if x in free:
                end = np.maximum(end, free[x])
        end = end + t
        for x in ls:
            free[x] = end
        done[r.dst] = np.maximum(done[r.dst], end) if r.dst in done else end
    first = np.minimum.reduce(list(done.values())) if done else zero
    last = np.maximum.reduce(list(done.values())) if done else zero
    chain = np.maximum(longest, busiest - (np.maximum(busiest, last) - first))
    if shared:  # routes sharing the busiest link all land at its end
        chain = busiest
    return busiest, out, inc, ud, chain


def route_links(sender: object, receiver: object, src_server: int, dst_server: int) -> tuple:
    """Directed links a transfer occupies (the edges of ``Cluster.graph()``): within a server the sender's and
    receiver's device links (NVLink); between servers the devices' links to the network ("xout"/"xin"),
    the source server's uplink and the destination server's downlink (its NIC)."""
    if src_server == dst_server:
        return (("out", sender), ("in", receiver))
    return (("xout", sender), ("up", src_server), ("down", dst_server), ("xin", receiver))
