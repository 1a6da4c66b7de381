"""Split-concat transfer costs (paper IV-A, communication stages): routes over the links of ``Cluster.graph()``."""

from __future__ import annotations

from heapq import heappop, heappush
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ...core.split_concat import Route


class ServerLoad(NamedTuple):
    """Ms per micro-batch that one communication stage keeps a server's network links busy."""

    server: int
    up: float  # its uplink (out of the server)
    down: float  # its downlink (into the server)


class CommLinks(NamedTuple):
    """One micro-batch's split-concat transfers across one cut between two stage layouts, in ms.

    ``busiest`` is the communication stage's F (gradients take the reverse routes: B = F). ``chain`` is what
    the gradients' way back adds to one micro-batch's round trip: the routes started as the simulator starts
    them (replicas with fewer rows first), each receiver's gradients leaving once its own data is in, less
    ``busiest`` (beyond ``LIST_ROUTES`` routes, or with shared links, a closed form). ``window`` is the same
    share in the steady state, where early receivers' gradients overlap later forward routes.
    """

    busiest: float  # the busiest link's load
    send: float  # the busiest sender device link's
    receive: float  # the busiest receiver device link's
    servers: tuple  # ServerLoad of every server the routes cross
    chain: float
    window: float
    hot: tuple  # receiver-side links that are a busiest link: ("in", receiver replica) or ("down", server)


class GradientPorts(NamedTuple):
    """Where the gradients of a cut's routes come into the senders' stage (:func:`queues`)."""

    own: frozenset  # sender replicas that take some on their own server's device link ("in")
    servers: frozenset  # servers whose downlink takes some from another server


class CommPair:
    """:class:`CommLinks` of a pair of stage layouts, cut by cut, in servers relabelled 0, 1, ... (CostModel.comm_pair
    maps them back).

    The routes ``rs`` from replicas on servers ``src`` to replicas on servers ``dst``, their links and the order
    the simulator starts them in are the same at every cut, only the bytes differ: those are worked out once
    here, a cut's numbers on first ask (:meth:`at`), once per distinct set of link loads and route times (cuts
    with the same bytes share them: a transformer's blocks).

    Args:
        rs: the split-concat routes of one micro-batch (``core.split_concat.routes``).
        src, dst: the server of each sender and receiver replica.
        route_times: ``(rows, same_server) -> (N,)`` ms of one route at every cut (CostModel.route_times).
        shared: ``Cluster.link_sharing == "shared"``.
        keep: cache each cut's answer (False for pairs over many servers, whose caches filled gigabytes).
    """

    def __init__(self, rs: Sequence[Route], src: tuple, dst: tuple, route_times: Callable[[int, bool], np.ndarray],
                 shared: bool = False, keep: bool = True):
        kinds: dict = {}  # (rows, same server) -> row of `times`
        kind = []  # each route's
        ids: dict = {}  # link -> its number, in order of first use
        paths = []  # each route's links, numbered
        for r in rs:
            a, b = src[r.src], dst[r.dst]
            kind.append(kinds.setdefault((r.rows, a == b), len(kinds)))
            links = route_links(("s", r.src), ("r", r.dst), a, b)
            paths.append(tuple([ids.setdefault(link, len(ids)) for link in links]))
        times = np.stack([route_times(rows, same) for rows, same in kinds])  # (kinds, N) ms
        self._index_links(ids, kind, paths, len(kinds), times)
        self._shared = shared
        # the steady state's share (window): the routes in posting order, (kind, links, receiver replica)
        self._posted = (kind, paths, [r.dst for r in rs])  # (lists, not a tuple per route: 128 x 8 keeps many)
        self._trip = None if shared or len(rs) > LIST_ROUTES else self._trip_order(rs, times)
        self.ports = gradient_ports(rs, src, dst)
        self._at: dict = {}  # a column of _cols -> its CommLinks, kept only with ``keep``
        self._keep = keep

    def _index_links(self, ids: dict, kind: list, paths: list, num_kinds: int, times: np.ndarray) -> None:
        """Each link's load per cut (a count of route kinds (rows, same server) times their times), and which
        links are device links, server links and receiver-side links (``ids``: link -> its number)."""
        names = list(ids)
        counts = [[0] * num_kinds for _ in names]
        for k, path in zip(kind, paths):
            for x in path:
                counts[x][k] += 1
        loads = np.array(counts, dtype=float) @ times  # (links, N): the ms each link is busy per micro-batch
        # links with the same counts share a row (on 128 x 8: pairs of hundreds of links). All links' rows in one
        # product: that of the distinct rows alone differs from it in the last bit now and then
        distinct: dict = {}  # counts -> (row, the first link with them)
        self._row = [distinct.setdefault(tuple(c), (len(distinct), x))[0] for x, c in enumerate(counts)]
        # (distinct loads + kinds, N): then each kind's route time
        self._cols = np.concatenate([loads[[x for _, x in distinct.values()]], times])
        self._rows, self._links = len(distinct), len(names)
        self._out = [x for x, (k, _) in enumerate(names) if k in ("out", "xout")]
        self._in = [x for x, (k, _) in enumerate(names) if k in ("in", "xin")]
        self._ud = [(s, ids.get(("up", s)), ids.get(("down", s)))
                    for s in sorted({who for (k, who) in names if k in ("up", "down")})]
        # the receiver-side links ("in", receiver replica) or ("down", server): hot where a busiest link (queues)
        inbound = [x for x, (k, _) in enumerate(names) if k in ("in", "down")]
        self._inbound = (inbound, [(k, who[1] if k == "in" else who) for k, who in (names[x] for x in inbound)])

    def _trip_order(self, rs: Sequence[Route], times: np.ndarray) -> tuple[list, list]:
        """One micro-batch's round trip (:meth:`_round_trip`): the order the simulator starts its routes each way
        (taken at the cut with the most bytes). The gradients take each route's links the other way: each link's
        reverse (a device's out for its in, a server's downlink for its uplink), shared by the same routes, so the
        routes' numbered links serve both ways."""
        kind, paths, dst = self._posted
        sent: dict = {}  # a replica's rows: one with fewer finishes its compute and posts its transfers first
        got: dict = {}
        for r in rs:
            sent[r.src] = sent.get(r.src, 0) + r.rows
            got[r.dst] = got.get(r.dst, 0) + r.rows
        n = self._links
        rep = int(np.argmax(times.sum(axis=0)))
        t = [times[k, rep].item() for k in kind]
        fw_order = _start_order([EARLY * sent[r.src] for r in rs], t, paths, n)
        done = _landed(dst, _replay([0.0] * len(rs), t, paths, fw_order, n))
        return fw_order, _start_order([done[r.dst] + EARLY * got[r.dst] for r in rs], t, paths, n)

    def at(self, layer: int) -> CommLinks:
        """The :class:`CommLinks` of one micro-batch's transfers after ``layer`` (``hot``: none with shared links)."""
        col = tuple(self._cols[:, layer].tolist())
        hit = self._at.get(col)
        if hit is None:
            rows = col[:self._rows]
            hit = self._cut([rows[x] for x in self._row], col[self._rows:])
            if self._keep:
                self._at[col] = hit
        return hit

    def _cut(self, loads: list, times: tuple) -> CommLinks:
        """:meth:`at` of a cut where the links carry ``loads`` and the route kinds take ``times`` (ms)."""
        busiest, longest = max(loads), max(times)
        out = max([loads[x] for x in self._out], default=0.0)
        inc = max([loads[x] for x in self._in], default=0.0)
        ud = tuple([ServerLoad(s, 0.0 if u is None else loads[u], 0.0 if d is None else loads[d])
                    for s, u, d in self._ud])
        if self._shared:  # routes sharing the busiest link all land at its end
            return CommLinks(busiest, out, inc, ud, busiest, busiest, ())
        top = busiest * (1 - 1e-9)
        hot = tuple([link for x, link in zip(*self._inbound) if loads[x] >= top])
        window = self._window(times, busiest, longest)
        if self._trip is None:  # many routes: the same closed form for the first micro-batch
            return CommLinks(busiest, out, inc, ud, window, window, hot)
        # the first micro-batch's: its round trip, the transfers started as the simulator does
        return CommLinks(busiest, out, inc, ud, max(longest, self._round_trip(times, self._trip) - busiest), window,
                         hot)

    def _window(self, times: tuple, busiest: float, longest: float) -> float:
        """The steady state's share: one micro-batch alone, routes in posting order, each when its links are free;
        a receiver's gradients start back before the others' data is in, overlapping later routes."""
        free = [0.0] * self._links
        done: dict = {}
        for kind, ls, d in zip(*self._posted):
            end = 0.0
            for x in ls:
                if free[x] > end:
                    end = free[x]
            end = end + times[kind]
            for x in ls:
                free[x] = end
            if d not in done or end > done[d]:
                done[d] = end
        first, last = min(done.values()), max(done.values())
        return max(longest, busiest - (max(busiest, last) - first))

    def _round_trip(self, times: tuple, trip: tuple[list, list]) -> float:
        """ms from the first activations leaving to the last gradients landing, for one micro-batch with nothing
        below the receivers (what is below shifts every receiver's gradients alike): the routes run as the
        simulator starts them, each receiver's gradients when its own data is in."""
        (kind, paths, dst), (fw_order, bw_order), n = self._posted, trip, self._links
        t = [times[k] for k in kind]
        done = _landed(dst, _replay([0.0] * len(t), t, paths, fw_order, n))
        return max(_replay([done[d] for d in dst], t, paths, bw_order, n))


def gradient_ports(rs: Sequence[Route], src: tuple, dst: tuple) -> GradientPorts:
    """Where the gradients of routes ``rs`` (from replicas on servers ``src`` to replicas on ``dst``) come into
    the senders' stage."""
    own = frozenset(r.src for r in rs if src[r.src] == dst[r.dst])
    return GradientPorts(own, frozenset(src[r.src] for r in rs if src[r.src] != dst[r.dst]))


def queues(hot: tuple, ports: GradientPorts) -> bool:
    """Whether a stage's first gradients queue behind its warmup activations: the simulator starts waiting
    transfers in order of readiness, so a gradient from the stage below waits on a link it shares with the
    activations from the stage above while earlier-posted ones hold it, which they do only where that link is
    the busiest of their transfer.

    Args:
        hot: ``CommLinks.hot`` of the cut above the stage.
        ports: :func:`gradient_ports` of the routes to the stage below.
    """
    own, servers = ports
    for k, who in hot:  # (a loop: the search asks this in its inner loop, where a generator costs more)
        if who in (own if k == "in" else servers):
            return True
    return False


NO_USERS = ((), ())  # a server's (uplink, downlink) communication stages before any crosses it (add_users)


def add_users(users: dict, servers: tuple, at: int) -> dict:
    """``users`` (server -> (uplink users, downlink users), each ((interleaved stage, ms per micro-batch), ...) in
    stage order) with communication stage ``at``'s ``servers`` (``CommLinks.servers``) added, as a new dict
    (``users`` is left as it was)."""
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
    all of j's load): l_i + sum_j min(l_j, l_i), at its busiest link."""
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


def _start_order(ready: list, dur: list, links: list, n: int) -> list:
    """Indices in the order the simulator starts them: at each event, every waiting transfer (in order of
    ``ready``, then index) whose links (``links``: numbers below ``n``, as CommPair numbers them) are all free
    starts. Between two events where no link frees, only the newly ready can start (the blocked stay blocked)."""
    free = [0.0] * n
    ends: list = []  # heap of the started transfers' ends: a link is taken only once free, so those after t are
    # the links' free times
    order = sorted(range(len(dur)), key=lambda x: (ready[x], x))
    k = 0  # order[k:]: not ready yet
    blocked: list = []  # ready, waiting for a link, in order
    out: list = []
    t, freed = 0.0, True
    while True:
        new = k
        while k < len(order) and ready[order[k]] <= t:
            k += 1
        scan = blocked + order[new:k] if freed else order[new:k]
        keep = [] if freed else blocked
        for x in scan:
            for link in links[x]:
                if free[link] > t:
                    keep.append(x)
                    break
            else:  # all its links free: it starts
                out.append(x)
                end = t + dur[x]
                for link in links[x]:
                    free[link] = end
                heappush(ends, end)
        blocked = keep
        if len(out) == len(order):
            return out
        # the next event: a link freed or a transfer ready
        while ends and ends[0] <= t:
            heappop(ends)
        nxt = ends[0] if ends else float("inf")
        if k < len(order) and ready[order[k]] < nxt:
            t, freed = ready[order[k]], False
        else:
            t, freed = nxt, True


def _replay(ready: list, t: list, links: list, order: list, n: int) -> list:
    """Each transfer's end, started in ``order`` (:func:`_start_order`): at the later of its ``ready`` time (>= 0)
    and its links' last transfer's end (``links``: numbers below ``n``)."""
    free = [0.0] * n
    ends: list = [0.0] * len(t)
    for x in order:
        end = ready[x]
        for link in links[x]:
            if free[link] > end:
                end = free[link]
        end = end + t[x]
        for link in links[x]:
            free[link] = end
        ends[x] = end
    return ends


def _landed(dst: list, ends: list) -> dict:
    """receiver -> when its last activations land, for transfers to receivers ``dst`` ending at ``ends``."""
    done: dict = {}
    for d, end in zip(dst, ends):
        if d not in done or end > done[d]:
            done[d] = end
    return done


def route_links(sender: object, receiver: object, src_server: int, dst_server: int) -> tuple:
    """Directed links a transfer occupies (the edges of ``Cluster.graph()``): within a server the sender's and
    receiver's device links (NVLink); between servers the devices' links to the network ("xout"/"xin"),
    the source server's uplink and the destination server's downlink (its NIC)."""
    if src_server == dst_server:
        return (("out", sender), ("in", receiver))
    return (("xout", sender), ("up", src_server), ("down", dst_server), ("xin", receiver))
