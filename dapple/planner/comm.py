"""Communication-stage costs (paper IV-A): split-concat routes over the links of ``Cluster.graph()``."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .slices import Route


def comm_tables(rs: Sequence[Route], src: tuple, dst: tuple, route_times: Callable[[int, bool], np.ndarray],
                shared: bool = False) -> tuple:
    """``CostModel.comm_links`` at every cut of the model at once, for routes ``rs`` from replicas on servers
    ``src`` to replicas on servers ``dst``: (busiest, out, in, ((server, uplink, downlink), ...), chain,
    window, hot), each an (N,) array over cuts (``CostModel.comm_links`` says what chain and window are), and
    ``hot``: ((link, (N,) bool), ...), each receiver-side link ("in", receiver replica) or ("down", server)
    that is a busiest link at some cut, and the cuts where it is (:func:`queues`; none with shared links). numpy over layers: the
    routes and links of two layouts are the same at every cut, only the bytes differ.
    ``route_times(rows, same_server)``: (N,) ms of one route at every cut; ``shared``: ``Cluster.link_sharing
    == "shared"``."""
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
    ud = [(s, *(loads[row[(k, s)]] if (k, s) in row else zero for k in ("up", "down"))) for s in servers]
    busiest = loads.max(axis=0)
    longest = times.max(axis=0)
    if shared:  # routes sharing the busiest link all land at its end
        return busiest, out, inc, ud, busiest, busiest, ()
    top = busiest * (1 - 1e-9)
    hot = tuple(((k, who[1] if k == "in" else who), at) for (k, who), at in zip(names, loads >= top)
                if k in ("in", "down") and at.any())
    # the steady state's share (window): one micro-batch alone, routes in posting order, each when its links are
    # free; a receiver's gradients start back before the others' data is in, overlapping later forward routes
    free: dict = {}
    done: dict = {}
    for r in rs:
        a, b = src[r.src], dst[r.dst]
        end = zero
        ls = route_links(r.src, r.dst, a, b)
        for x in ls:
            if x in free:
                end = np.maximum(end, free[x])
        end = end + times[kinds[(r.rows, a == b)]]
        for x in ls:
            free[x] = end
        done[r.dst] = np.maximum(done[r.dst], end) if r.dst in done else end
    first = np.minimum.reduce(list(done.values()))
    last = np.maximum.reduce(list(done.values()))
    window = np.maximum(longest, busiest - (np.maximum(busiest, last) - first))
    if len(rs) > LIST_ROUTES:  # many routes: the same closed form for the first micro-batch
        return busiest, out, inc, ud, window, window, hot
    # the first micro-batch's: its round trip, the transfers started as the simulator does
    return (busiest, out, inc, ud, np.maximum(longest, _round_trip(rs, src, dst, times, kinds) - busiest), window,
            hot)


def gradient_ports(rs: Sequence[Route], src: tuple, dst: tuple) -> tuple[frozenset, frozenset]:
    """Where the gradients of routes ``rs`` come into the senders' stage: (sender replicas that take some on
    their own server's device link ("in"), servers whose downlink takes some from another server)."""
    own = frozenset(r.src for r in rs if src[r.src] == dst[r.dst])
    return own, frozenset(src[r.src] for r in rs if src[r.src] != dst[r.dst])


def queues(hot: tuple, ports: tuple[frozenset, frozenset]) -> bool:
    """Whether a stage's first gradients queue behind its warmup activations: the simulator starts waiting
    transfers in order of readiness, so a gradient from the stage below waits on a link it shares with the
    activations from the stage above while earlier-posted ones hold it, which they do only where that link is
    the busiest of their transfer (``hot``: ``CostModel.comm_links``' links at the cut above the stage,
    (("in", receiver replica) or ("down", server), ...); ``ports``: :func:`gradient_ports` of the routes to
    the stage below)."""
    own, servers = ports
    return any(who in (own if k == "in" else servers) for k, who in hot)


NO_USERS = ((), ())  # a server's (uplink, downlink) communication stages before any crosses it (add_users)


def add_users(users: dict, servers: tuple, at: int) -> dict:
    """``users`` (server -> (uplink users, downlink users), each ((interleaved stage, ms per micro-batch), ...) in
    stage order) with communication stage ``at``'s server loads ``servers`` ((server, uplink ms, downlink ms),
    ...: ``CostModel.comm_links``) added, as a new dict (``users`` is left as it was)."""
    out = dict(users)
    for s, u, d in servers:
        ups, downs = out.get(s, NO_USERS)
        out[s] = (ups + ((at, u),) if u > 0 else ups, downs + ((at, d),) if d > 0 else downs)
    return out


def feeds(users: dict, n: int) -> list | None:
    """Per interleaved stage (``n`` of them), the least ms per micro-batch at which a communication stage's
    activations get through while everyone warms up, where a server's uplink or downlink carries several
    communication stages' activations (``users``: :func:`add_users`), or None where no link does. Stage i's
    transfers queue with every other stage j's on the link, each of j's taking at most as long as i's own
    (a heavier stage j is itself the slower flow: i's transfers wait for one of j's routes at a time, not for
    all of j's load): l_i + sum_j min(l_j, l_i), at its busiest link (benchmarks/RESULTS.md "Estimate vs
    simulator")."""
    out = None
    for ups, downs in users.values():
        for us in (ups, downs):
            if len(us) < 2:
                continue
            if out is None:
                out = [0.0] * n
            for i, li in us:
                t = li
                for j, lj in us:
                    if j != i:
                        t += lj if lj < li else li
                if t > out[i]:
                    out[i] = t
    return out


LIST_ROUTES = 24  # routes of a pair of layouts up to which they are scheduled as the simulator does
EARLY = 1e-9  # ms per row: a replica's compute ends this much later per row it has (only the order counts)


def _start_order(ready: list, dur: list, links: list) -> list:
    """Indices in the order the simulator starts them: at each event, every waiting transfer (in order) whose
    links are all free starts."""
    free: dict = {}
    waiting = sorted(range(len(dur)), key=lambda x: (ready[x], x))
    out: list = []
    t = 0.0
    while waiting:
        still = []
        for x in waiting:
            if ready[x] <= t:
                for link in links[x]:
                    if free.get(link, 0.0) > t:
                        break
                else:  # all its links free: it starts
                    out.append(x)
                    end = t + dur[x]
                    for link in links[x]:
                        free[link] = end
                    continue
            still.append(x)
        waiting = still
        if waiting:  # the next event: a link freed or a transfer ready
            nxt = float("inf")
            for v in free.values():
                if t < v < nxt:
                    nxt = v
            for x in waiting:
                v = ready[x]
                if t < v < nxt:
                    nxt = v
            t = nxt
    return out


def _round_trip(rs: Sequence[Route], src: tuple, dst: tuple, times: np.ndarray, kinds: dict) -> np.ndarray:
    """(N,) ms from the first activations leaving to the last gradients landing, for one micro-batch with
    nothing below the receivers (what is below shifts every receiver's gradients alike): the routes run as
    the simulator starts them (order taken at the cut with the most bytes), each receiver's gradients when its
    own data is in."""
    rep = int(np.argmax(times.sum(axis=0)))
    rows_of: dict = {}  # a replica's rows: one with fewer finishes its compute and posts its transfers first
    for r in rs:
        rows_of[("s", r.src)] = rows_of.get(("s", r.src), 0) + r.rows
        rows_of[("r", r.dst)] = rows_of.get(("r", r.dst), 0) + r.rows
    fw = [route_links(("s", r.src), ("r", r.dst), src[r.src], dst[r.dst]) for r in rs]
    t = [times[kinds[(r.rows, src[r.src] == dst[r.dst])]] for r in rs]
    zero = np.zeros(times.shape[1])
    done: dict = {}  # receiver -> when its last activations land
    for r, end in zip(rs, _replay([zero] * len(rs), [EARLY * rows_of[("s", r.src)] for r in rs], t, fw, rep)):
        done[r.dst] = np.maximum(done[r.dst], end) if r.dst in done else end
    bw = [route_links(("r", r.dst), ("s", r.src), dst[r.dst], src[r.src]) for r in rs]
    early = [EARLY * rows_of[("r", r.dst)] for r in rs]
    return np.maximum.reduce(_replay([done[r.dst] for r in rs], early, t, bw, rep))


def _replay(ready: list, early: list, t: list, links: list, rep: int) -> list:
    """Each transfer's (N,) end, started as the simulator does (:func:`_start_order` at cut ``rep``): at the
    later of its ``ready`` time and its links' last transfer's end. ``early``: a tie-break on readiness."""
    free: dict = {}
    ends: list = [None] * len(t)
    for x in _start_order([float(r[rep]) + e for r, e in zip(ready, early)], [float(v[rep]) for v in t], links):
        end = ready[x]
        for link in links[x]:
            if link in free:
                end = np.maximum(end, free[link])
        end = end + t[x]
        for link in links[x]:
            free[link] = end
        ends[x] = end
    return ends


def route_links(sender: object, receiver: object, src_server: int, dst_server: int) -> tuple:
    """Directed links a transfer occupies (the edges of ``Cluster.graph()``): within a server the sender's and
    receiver's device links (NVLink); between servers the devices' links to the network ("xout"/"xin"),
    the source server's uplink and the destination server's downlink (its NIC)."""
    if src_server == dst_server:
        return (("out", sender), ("in", receiver))
    return (("xout", sender), ("up", src_server), ("down", dst_server), ("xin", receiver))
