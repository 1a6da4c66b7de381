"""Per-stage costs (paper IV-A): a micro-batch slice's compute, split-concat transfers, ring AllReduce."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...core.buckets import BUCKET_BYTES, bucket
from ...core.checks import number, positive_int
from ...core.split_concat import routes
from .transfers import CommPair

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

Layout = tuple  # the server of each replica of a stage, in replica order: (0, 0, 1) = 2 replicas on server 0, 1 on 1

CACHED_SERVERS = 16  # CostModel.comm_pair caches its per-cut answers for pairs of stages over at most this many servers


def layout_of(cluster: "Cluster", devices: Sequence[int]) -> Layout:
    """Server of each replica, in the stage's device order (all costs depend on devices only through this)."""
    return tuple(cluster.server_of(d) for d in devices)


class CostModel:
    """Costs of stages of one profile on one cluster at one micro-batch size, in milliseconds (memoised).

    A stage is layers ``[a, c)`` on ``r`` replicas; each replica runs a slice of the micro-batch and the
    slowest holds ``ceil(micro / r)`` rows (``slices.slice_bounds``), which sets the stage's F and B.
    Parameters tied across stages (e.g. a GPT's embedding and head) are counted once, at the layer that owns
    them in the profile; their cross-stage gradient exchange is ignored by this model.
    """

    def __init__(self, profile: "Profile", cluster: "Cluster", micro_batch_size: int,
                 optimizer_factor: float = 4.0, bucket_bytes: float = BUCKET_BYTES):
        positive_int("micro_batch_size", micro_batch_size)
        number("optimizer_factor", optimizer_factor, positive=True)
        number("bucket_bytes", bucket_bytes, positive=True, finite=True)
        self.profile, self.cluster, self.micro = profile, cluster, micro_batch_size
        self.optimizer_factor, self.bucket_bytes = float(optimizer_factor), float(bucket_bytes)
        self.num_layers = profile.num_layers
        params = profile.costs(micro_batch_size).param_bytes
        self.param_bytes = list(params)
        self._pre_params = _prefix(params)
        self._prefix: dict[int, tuple[list[float], list[float], list[float]]] = {}
        # what a stage op pays once for being called, forward and backward (Profile.call_ms): _sums holds the layers'
        # times without it, compute_rows adds it to each stage
        self.call_f, self.call_b = (float(v) for v in profile.call_ms)
        self._comm: dict = {}  # (src, dst) -> comm_pair, filled on use
        self._comm_canon: dict[tuple, CommPair] = {}  # the same for servers relabelled 0, 1, ...
        self._routes: dict[tuple, list] = {}  # (senders, receivers) -> slices.routes of a micro-batch
        self._bbytes: dict[int, np.ndarray] = {}
        self._routes_ms: dict[tuple, np.ndarray] = {}
        self._ar: dict[tuple, float] = {}

    # ---- compute ---------------------------------------------------------------------------------
    def rows(self, replicas: int) -> int:
        """Rows of the largest slice of a micro-batch split over ``replicas`` (the slowest replica)."""
        return -(-self.micro // replicas)

    def _sums(self, rows: int) -> tuple[list[float], list[float], list[float]]:
        """Prefix sums over layers of forward ms, backward ms and saved bytes of a ``rows``-row slice; the times
        without the call cost (Profile.call_ms), which a layer timed alone paid and a stage pays once."""
        hit = self._prefix.get(rows)
        if hit is None:
            fw, bw = self.profile.net_ms(rows)
            hit = self._prefix[rows] = (_prefix(fw), _prefix(bw), _prefix(self.profile.costs(rows).saved_bytes))
        return hit

    def compute_rows(self, a: int, c: int, rows: int) -> tuple[float, float]:
        """(forward ms, backward ms) of layers [a, c) on a slice of ``rows`` rows, run as one op (a < c)."""
        f, b, _ = self._sums(rows)
        return f[c] - f[a] + self.call_f, b[c] - b[a] + self.call_b

    def compute(self, a: int, c: int, replicas: int) -> tuple[float, float]:
        """(F_s, B_s): forward and backward ms of layers [a, c) on the slowest of ``replicas`` replicas."""
        return self.compute_rows(a, c, self.rows(replicas))

    def saved_bytes(self, a: int, c: int, replicas: int) -> float:
        """Activations one micro-batch slice keeps for backward on the slowest replica of layers [a, c)."""
        s = self._sums(self.rows(replicas))[2]
        return s[c] - s[a]

    def params(self, a: int, c: int) -> float:
        return self._pre_params[c] - self._pre_params[a]

    # ---- communication stages ----------------------------------------------------------------------
    def route_ms(self, layer: int, rows: int, src_server: int, dst_server: int) -> float:
        """One split-concat transfer of ``rows`` rows of the tensors crossing a cut after ``layer``."""
        return float(self._route_times(rows, src_server == dst_server)[layer])

    def _route_times(self, rows: int, same_server: bool) -> np.ndarray:
        """(N,): :meth:`route_ms` at every cut, within a server or between servers (memoised)."""
        hit = self._routes_ms.get((rows, same_server))
        if hit is None:
            cl = self.cluster
            bw, lat = ((cl.intra_bandwidth, cl.intra_latency) if same_server
                       else (cl.inter_bandwidth, cl.inter_latency))
            hit = self._routes_ms[(rows, same_server)] = (lat + self._boundary(rows) / bw) * 1e3
        return hit

    def comm(self, layer: int, src: Layout, dst: Layout) -> tuple[float, float]:
        """(F, B) of the communication stage after ``layer`` between stages placed as ``src`` and ``dst``.

        Each split-concat route (``slices.routes``) takes latency + bytes / bandwidth of the slowest link it
        crosses (``Cluster.link``). Routes sharing a link run one after another: a sender's and a receiver's
        device link, and for cross-server routes the servers' up- and downlinks (the edges of
        ``Cluster.graph()``). The stage time is the busiest link's total. Gradients (B) travel the reverse
        routes with the same bytes, so B = F.
        """
        t = self.comm_links(layer, src, dst)[0]
        return t, t

    def comm_links(self, layer: int, src: Layout, dst: Layout) -> tuple:
        """(busiest link ms, busiest sender device link ms, busiest receiver device link ms,
        ((server, its uplink ms, its downlink ms), ...), chain ms, window ms, hot) of one micro-batch's transfers
        after ``layer``.

        ``chain``: what the gradients' way back adds to one micro-batch's round trip, whose activations'
        share is the busiest link. Up to ``comm.LIST_ROUTES`` routes: the round trip of one micro-batch, its
        transfers started as the simulator starts them (any whose links are free, replicas with fewer rows
        first), each receiver's gradients when its own data is in, less the busiest link. Split-concat routes
        between unequal replica counts chain through alternately shared links, so the last receiver's data
        can land well after its own link's load. With more routes, a closed form: max(longest route, B -
        (last - first receiver's arrival)). Links shared between routes (``Cluster.link_sharing ==
        "shared"``): B, the routes on the busiest link all land when it is done.

        ``window``: the same share in the steady state, where a stage holds K_i micro-batches per round trip:
        that closed form, since there early receivers' gradients overlap later forward routes.

        ``hot``: the receiver-side links that are a busiest link, (("in", receiver replica) or ("down",
        server), ...) (:func:`comm.queues`); ``comm_pair(src, dst).ports`` says where the gradients of the
        same routes come in (:func:`comm.gradient_ports`)."""
        return self.comm_pair(src, dst)(layer)

    def comm_pair(self, src: Layout, dst: Layout):
        """``layer -> comm_links(layer, src, dst)`` (memoised per pair: the search asks one pair at many cuts)."""
        pair = self._comm.get((src, dst))
        if pair is None:  # costs see servers only as same-or-not: one comm.CommPair per relabelling (first use order)
            label: dict = {}
            for s in src + dst:
                label.setdefault(s, len(label))
            key = (tuple(label[s] for s in src), tuple(label[s] for s in dst))
            canon = self._comm_canon.get(key)
            if canon is None:
                rs = self._routes.get((len(src), len(dst)))
                if rs is None:
                    rs = self._routes[(len(src), len(dst))] = routes(self.micro, len(src), len(dst))
                canon = self._comm_canon[key] = CommPair(rs, *key,
                                                         self._route_times, self.cluster.link_sharing == "shared",
                                                         keep=len(label) <= CACHED_SERVERS)
            server = list(label)
            at = canon.at
            # per-cut answers are cached for pairs over a few servers; over many (128 x 8) the caches of tens of
            # thousands of pairs with a (server, ms) entry per server filled gigabytes: those are rebuilt per ask
            cache = [None] * self.num_layers if len(server) <= CACHED_SERVERS else None

            def pair(layer: int) -> tuple:  # (refers to no CostModel: no reference cycle keeps the caches alive)
                hit = cache[layer] if cache is not None else None
                if hit is None:
                    bz, o, i, ud, ch, w, hot = at(layer)
                    hit = (bz, o, i, tuple([(server[s], u, d) for s, u, d in ud]), ch, w,
                           tuple([(k, server[who] if k == "down" else who) for k, who in hot]))
                    if cache is not None:
                        cache[layer] = hit
                return hit

            own, ports_at = canon.ports
            pair.ports = (own, frozenset([server[s] for s in ports_at]))  # type: ignore[attr-defined]
            self._comm[(src, dst)] = pair
        return pair

    def forget_comm(self) -> None:
        """Drop the memoised :meth:`comm_pair` tables (a long search bounds its memory with this)."""
        self._comm.clear()
        self._comm_canon.clear()

    def _boundary(self, rows: int) -> np.ndarray:
        """(N,): bytes crossing each cut for a slice of ``rows`` rows."""
        hit = self._bbytes.get(rows)
        if hit is None:
            hit = self._bbytes[rows] = np.asarray(self.profile.costs(rows).boundary_bytes, dtype=float)
        return hit

    def link_periods(self, spans: Sequence[tuple[int, int, Layout]]) -> tuple[float, float]:
        """(period, drain): the least ms per micro-batch the links allow in the steady phase, where a device link
        carries its stage's activations forward and gradients back (two communication stages) and a server's
        uplink and downlink every cross-server transfer of the plan in either direction; and once activations
        have stopped (the drain), where each link carries gradients alone: a device link one communication
        stage's, a server's uplink the gradients of what its downlink took forward."""
        period = drain = prev_in = 0.0
        up: dict = {}
        down: dict = {}
        for i in range(len(spans) - 1):
            _, out, inc, servers, _, _, _ = self.comm_links(spans[i][1] - 1, spans[i][2], spans[i + 1][2])
            period = max(period, out + prev_in)
            drain = max(drain, out, inc)
            prev_in = inc
            for s, u, d in servers:
                up[s] = up.get(s, 0.0) + u
                down[s] = down.get(s, 0.0) + d
        period = max([period, prev_in] + [up[s] + down[s] for s in up])
        return period, max([drain] + list(up.values()) + list(down.values()))

    # ---- AllReduce ---------------------------------------------------------------------------------
    def ring_allreduce_ms(self, nbytes: float, layout: Layout) -> float:
        """Ring AllReduce: 2(r-1)/r * P / bw + 2(r-1) * latency over the slowest link the set spans."""
        return self._ring_ms(nbytes, len(layout), len(set(layout)) > 1)

    def _ring_ms(self, nbytes: float, replicas: int, spans_servers: bool) -> float:
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        share, bw, steps = self._ring(replicas, spans_servers)
        return (share * nbytes / bw + steps) * 1e3

    def _ring(self, r: int, spans_servers: bool) -> tuple[float, float, float]:
        """(2(r-1)/r, bus bandwidth, 2(r-1) x latency per step) of a ring over r devices."""
        bw, lat = self.cluster.allreduce_link(spans_servers=spans_servers, replicas=r)
        return 2 * (r - 1) / r, bw, 2 * (r - 1) * lat

    def allreduce(self, a: int, c: int, layout: Layout) -> float:
        """AR(P_s, g_s) of formula 2: the gradients of layers [a, c) over the stage's replicas."""
        return self.allreduce_of(a, c, len(layout), len(set(layout)) > 1)

    def allreduce_of(self, a: int, c: int, replicas: int, spans_servers: bool) -> float:
        """:meth:`allreduce` for ``replicas`` devices that do or do not span servers (memoised)."""
        key = (a, c, replicas, spans_servers)
        hit = self._ar.get(key)
        if hit is None:
            hit = self._ar[key] = self._ring_ms(self.params(a, c), replicas, spans_servers)
        return hit

    def allreduce_ends(self, a: int, end: int, replicas: int, spans_servers: bool) -> list[float]:
        """``[allreduce_of(a, c, replicas, spans_servers) for c in range(a + 1, end)]``, computed at once."""
        if replicas <= 1:
            return [0.0] * (end - a - 1)
        share, bw, steps = self._ring(replicas, spans_servers)
        pre = self._pre_params
        p0 = pre[a]
        return [(share * (pre[c] - p0) / bw + steps) * 1e3 if pre[c] - p0 > 0 else 0.0 for c in range(a + 1, end)]

    def buckets(self, a: int, c: int) -> list[tuple[int, float]]:
        """Gradient buckets of layers [a, c) in backward order, by the runtime's rule (core.buckets): (lowest
        layer, bytes) each."""
        layers = [layer for layer in range(c - 1, a - 1, -1) if self.param_bytes[layer] > 0]
        groups = bucket([self.param_bytes[layer] for layer in layers], self.bucket_bytes)
        return [(layers[g[-1]], sum(self.param_bytes[layers[i]] for i in g)) for g in groups]

    def bucket_ready(self, a: int, c: int, rows: int) -> list[tuple[float, float]]:
        """Per bucket of :meth:`buckets`: (ms from the start of the last backward of a ``rows``-row slice until
        it has produced the bucket's gradients, bytes). That backward runs layers c-1 .. a (after the call's own
        cost); a bucket is done after its lowest layer."""
        bsum = self._sums(rows)[1]
        return [(bsum[c] - bsum[low] + self.call_b, nbytes) for low, nbytes in self.buckets(a, c)]

    def overlapped_ending(self, a: int, c: int, layout: Layout, rows: int | None = None) -> float:
        """Ms from the start of the stage's last backward to the end of its AllReduce, when each bucket is
        reduced as soon as the last backward has produced it (DDP-style overlap); >= that backward's time."""
        rows = self.rows(len(layout)) if rows is None else rows
        _, b = self.compute_rows(a, c, rows)
        if len(layout) <= 1:
            return b
        end = 0.0
        for ready, nbytes in self.bucket_ready(a, c, rows):
            end = max(end, ready) + self.ring_allreduce_ms(nbytes, layout)
        return max(end, b)

    # ---- memory --------------------------------------------------------------------------------------
    def static_bytes(self, a: int, c: int) -> float:
        """Parameters x optimizer factor (4: fp32 weights, gradients, Adam's two moments: 16 B/param)."""
        return self.params(a, c) * self.optimizer_factor


def _prefix(values: Sequence[float]) -> list[float]:
    out, acc = [0.0], 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out
