"""Per-stage costs (paper IV-A): a micro-batch slice's compute, split-concat transfers, ring AllReduce."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from ...core.buckets import BUCKET_BYTES, bucket
from ...core.checks import flag, number, positive_int
from ...core.plan import RECOMPUTE, Recompute
from ...core.split_concat import routes
from .. import tuning
from .memory import StageBytes, activation_scale, recompute_mode, static_factor
from .transfers import CommLinks, CommPair, GradientPorts, ServerLoad

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

ServerLayout = tuple[int, ...]  # the server of each replica of a stage, in order: (0, 0, 1) = 2 on server 0, 1 on 1


class Span(NamedTuple):
    """A stage as the models see it: layers [start, end) on replicas placed as ``layout``."""

    start: int
    end: int
    layout: ServerLayout


class PrefixSums(NamedTuple):
    """Prefix sums over layers of one slice size (entry c - entry a = layers [a, c)); times without the call cost."""

    forward: list[float]  # ms
    backward: list[float]  # ms
    saved: list[float]  # bytes kept for backward


class RingTerms(NamedTuple):
    """A ring AllReduce over r devices: (share * bytes / bandwidth + latency) s."""

    share: float  # 2(r-1)/r: the share of the bytes each device sends
    bandwidth: float  # bus bandwidth, B/s
    latency: float  # 2(r-1) x the latency of one step, s


class LinkPeriods(NamedTuple):
    """The least ms per micro-batch the links allow (:meth:`CostModel.link_periods`)."""

    period: float  # in the steady phase, activations forward and gradients back
    drain: float  # once activations have stopped: gradients alone


def layout_of(cluster: "Cluster", devices: Sequence[int]) -> ServerLayout:
    """Server of each replica, in the stage's device order (all costs depend on devices only through this)."""
    return tuple(cluster.server_of(d) for d in devices)


class PairCosts:
    """``layer -> CommLinks`` of the transfers between two stage layouts (:meth:`CostModel.comm_pair`), with
    ``ports``, where their gradients come into the senders (:func:`transfers.gradient_ports`). It refers to no
    CostModel, so no reference cycle keeps the caches alive."""

    __slots__ = ("_at", "_server", "_cache", "ports")

    def __init__(self, canon: CommPair, server: list[int], num_layers: int):
        self._at = canon.at
        self._server = server  # canonical label -> server
        # per-cut answers are cached for pairs over a few servers; over many (128 x 8) the caches of tens of
        # thousands of pairs with an entry per server filled gigabytes: those are rebuilt per ask
        self._cache: list | None = [None] * num_layers if len(server) <= tuning.TUNING.cached_servers else None
        own, ports_at = canon.ports
        self.ports = GradientPorts(own, frozenset([server[s] for s in ports_at]))

    def __call__(self, layer: int) -> CommLinks:
        cache = self._cache
        hit = cache[layer] if cache is not None else None
        if hit is None:
            server = self._server
            bz, o, i, ud, ch, w, hot = self._at(layer)
            hit = CommLinks(bz, o, i, tuple([ServerLoad(server[s], u, d) for s, u, d in ud]), ch, w,
                            tuple([(k, server[who] if k == "down" else who) for k, who in hot]))
            if cache is not None:
                cache[layer] = hit
        return hit


class CostModel:
    """Costs of stages of one profile on one cluster at one micro-batch size, in milliseconds (memoised).

    A stage is layers ``[a, c)`` on ``r`` replicas; each replica runs a slice of the micro-batch and the
    slowest holds ``ceil(micro / r)`` rows (``core.split_concat.slice_bounds``), which sets the stage's F and B.
    Parameters tied across stages (e.g. a GPT's embedding and head) are counted once, at the layer that owns
    them in the profile; their cross-stage gradient exchange is ignored by this model.

    Args:
        profile, cluster: what is planned, and where.
        micro_batch_size: rows of one micro-batch.
        optimizer_factor: static bytes per parameter byte (4: fp32 weights, gradients, Adam's two moments).
        bucket_bytes: the gradient bucket size of the overlapped AllReduce (``core.buckets``).
        recompute: how the stages it prices recompute activations by default (``core.plan.RECOMPUTE``; methods
            take it per stage too). "selective" needs a profile that measured it (``Profile.selective``).
        mixed_precision: "bf16" or "fp16": activations (saved and sent) take half the profiled fp32 bytes;
            parameters, gradients, optimizer state and the gradient AllReduce stay fp32. None: full precision.
        shard_optimizer: the optimizer state of a stage on r replicas is sharded over them (ZeRO-1): each holds
            1/r of it (:func:`memory.static_factor`).
    """

    def __init__(self, profile: "Profile", cluster: "Cluster", micro_batch_size: int,
                 optimizer_factor: float = 4.0, bucket_bytes: float = BUCKET_BYTES, *,
                 recompute: Recompute = False, mixed_precision: str | None = None, shard_optimizer: bool = False):
        positive_int("micro_batch_size", micro_batch_size)
        number("optimizer_factor", optimizer_factor, positive=True)
        number("bucket_bytes", bucket_bytes, positive=True, finite=True)
        recompute_mode(recompute, RECOMPUTE)
        flag("shard_optimizer", shard_optimizer, "shard each stage's optimizer state over its replicas")
        self.recompute: Recompute = recompute
        if recompute == "selective":
            profile.selective_costs(micro_batch_size)  # (a ValueError now, where the profile cannot price it)
        self.mixed_precision, self.shard_optimizer = mixed_precision, shard_optimizer
        self.activation_scale = activation_scale(mixed_precision)  # bytes of an activation per profiled byte
        self.profile, self.cluster, self.micro = profile, cluster, micro_batch_size
        self.optimizer_factor, self.bucket_bytes = float(optimizer_factor), float(bucket_bytes)
        self.num_layers = profile.num_layers
        params = profile.costs(micro_batch_size).param_bytes
        self.param_bytes = list(params)
        self.param_prefix = _prefix(params)  # prefix sums of param_bytes over layers
        self._prefix: dict[int, PrefixSums] = {}
        # what a stage op pays once for being called, forward and backward (Profile.call_ms): prefix_sums holds the
        # layers' times without it, compute_rows adds it to each stage
        self.call_f, self.call_b = (float(v) for v in profile.call_ms)
        self._comm: dict[tuple, PairCosts] = {}  # (src, dst) -> comm_pair, filled on use
        self._comm_canon: dict[tuple, CommPair] = {}  # the same for servers relabelled 0, 1, ...
        self._routes: dict[tuple, list] = {}  # (senders, receivers) -> split_concat.routes of a micro-batch
        self._bbytes: dict[int, np.ndarray] = {}
        self._selective: dict[int, tuple[list[float], list[float]]] = {}  # rows -> prefix sums (bytes, ms)
        self._routes_ms: dict[tuple, np.ndarray] = {}
        self._ar: dict[tuple, float] = {}

    # ---- compute ---------------------------------------------------------------------------------
    def rows(self, replicas: int) -> int:
        """Rows of the largest slice of a micro-batch split over ``replicas`` (the slowest replica)."""
        return -(-self.micro // replicas)

    def prefix_sums(self, rows: int) -> PrefixSums:
        """Forward ms, backward ms and saved bytes of a ``rows``-row slice summed over layers; the times without
        the call cost (Profile.call_ms), which a layer timed alone paid and a stage pays once (memoised)."""
        hit = self._prefix.get(rows)
        if hit is None:
            fw, bw = self.profile.net_ms(rows)
            scale = self.activation_scale
            hit = self._prefix[rows] = PrefixSums(_prefix(fw), _prefix(bw),
                                                  _prefix([x * scale for x in self.profile.costs(rows).saved_bytes]))
        return hit

    def compute_rows(self, a: int, c: int, rows: int, recompute: Recompute = False) -> tuple[float, float]:
        """(forward ms, backward ms) of layers [a, c) on a slice of ``rows`` rows, run as one op (a < c); a
        recomputing stage's backward runs its forward again first: all of it (True, "layers"), or what selective
        recomputation does not keep ("selective": the profile's ``selective_ms``)."""
        f, b, _ = self.prefix_sums(rows)
        fw = f[c] - f[a] + self.call_f
        bw = b[c] - b[a] + self.call_b
        if recompute == "selective":
            return fw, bw + self.recompute_ms(a, c, rows, recompute)
        return fw, bw + fw if recompute else bw

    def recompute_ms(self, a: int, c: int, rows: int, recompute: Recompute) -> float:
        """What recomputation adds to the backward of layers [a, c) on a ``rows``-row slice: nothing, the forward
        (True, "layers"), or the profile's ``selective_ms`` summed ("selective")."""
        if recompute == "selective":
            ms = self._selective_sums(rows)[1]
            return ms[c] - ms[a]
        return self.compute_rows(a, c, rows)[0] if recompute else 0.0

    def _selective_sums(self, rows: int) -> tuple[list[float], list[float]]:
        """Prefix sums over layers of (bytes kept, ms added) under selective recomputation (memoised)."""
        hit = self._selective.get(rows)
        if hit is None:
            kept, ms = self.profile.selective_costs(rows)
            hit = self._selective[rows] = (_prefix([x * self.activation_scale for x in kept]), _prefix(ms))
        return hit

    def compute(self, a: int, c: int, replicas: int, recompute: Recompute | None = None) -> tuple[float, float]:
        """(F_s, B_s): forward and backward ms of layers [a, c) on the slowest of ``replicas`` replicas
        (``recompute`` None: the model's own)."""
        return self.compute_rows(a, c, self.rows(replicas), self.recompute if recompute is None else recompute)

    def saved_bytes(self, a: int, c: int, replicas: int) -> float:
        """Activations one micro-batch slice keeps for backward on the slowest replica of layers [a, c)."""
        s = self.prefix_sums(self.rows(replicas)).saved
        return s[c] - s[a]

    def input_bytes(self, a: int, replicas: int) -> float:
        """What a recomputing stage from layer ``a`` keeps per micro-batch slice in flight: the activations that
        enter it (the tensors crossing the cut before ``a``). The first stage's are the model's input rows, which
        the profile does not measure and the caller holds in any case: 0."""
        return 0.0 if a == 0 else float(self._boundary(self.rows(replicas))[a - 1])

    def stage_bytes(self, a: int, c: int, replicas: int, recompute: Recompute) -> StageBytes:
        """What layers [a, c) on ``replicas`` replicas hold (memory.StageBytes), recomputing or not.

        Per slice in flight and once beside them (while one slice's backward recomputes): no recomputation, all its
        saved activations; True, its inputs, and once the whole stage's activations; "layers", every layer's
        inputs (the tensors crossing each cut inside the stage), and once the largest layer's activations;
        "selective", its inputs and what the profile says selective recomputation keeps, and once the rest."""
        static, saved = self.static_bytes(a, c, replicas), self.saved_bytes(a, c, replicas)
        rows = self.rows(replicas)
        if recompute == "layers":
            inside = float(self._boundary(rows)[a:c - 1].sum())
            one = max(self.profile.costs(rows).saved_bytes[a:c]) * self.activation_scale
            return StageBytes(static, self.input_bytes(a, replicas) + inside, one)
        if recompute == "selective":
            sums = self._selective_sums(rows)[0]
            kept = sums[c] - sums[a]
            return StageBytes(static, self.input_bytes(a, replicas) + kept, max(0.0, saved - kept))
        if recompute:
            return StageBytes(static, self.input_bytes(a, replicas), saved)
        return StageBytes(static, saved)

    def fits(self, a: int, c: int, replicas: int, recompute: Recompute | None = None) -> int:
        """D: micro-batch slices of layers [a, c) on ``replicas`` replicas that fit in device memory at once
        (``recompute`` None: the model's own)."""
        rc = self.recompute if recompute is None else recompute
        return self.stage_bytes(a, c, replicas, rc).slices(self.cluster.device_memory)

    def params(self, a: int, c: int) -> float:
        """Parameter bytes of layers [a, c)."""
        return self.param_prefix[c] - self.param_prefix[a]

    # ---- communication stages ----------------------------------------------------------------------
    def route_ms(self, layer: int, rows: int, src_server: int, dst_server: int) -> float:
        """One split-concat transfer of ``rows`` rows of the tensors crossing a cut after ``layer``."""
        return float(self.route_times(rows, src_server == dst_server)[layer])

    def route_times(self, rows: int, same_server: bool) -> np.ndarray:
        """(N,): :meth:`route_ms` at every cut, within a server or between servers (memoised)."""
        hit = self._routes_ms.get((rows, same_server))
        if hit is None:
            cl = self.cluster
            bw, lat = ((cl.intra_bandwidth, cl.intra_latency) if same_server
                       else (cl.inter_bandwidth, cl.inter_latency))
            hit = self._routes_ms[(rows, same_server)] = (lat + self._boundary(rows) / bw) * 1e3
        return hit

    def comm(self, layer: int, src: ServerLayout, dst: ServerLayout) -> tuple[float, float]:
        """(F, B) of the communication stage after ``layer`` between stages placed as ``src`` and ``dst``.

        Each split-concat route (``core.split_concat.routes``) takes latency + bytes / bandwidth of the slowest
        link it crosses (``Cluster.link``). Routes sharing a link run one after another: a sender's and a
        receiver's device link, and for cross-server routes the servers' up- and downlinks (the edges of
        ``Cluster.graph()``). The stage time is the busiest link's total. Gradients (B) travel the reverse
        routes with the same bytes, so B = F.
        """
        t = self.comm_links(layer, src, dst).busiest
        return t, t

    def comm_links(self, layer: int, src: ServerLayout, dst: ServerLayout) -> CommLinks:
        """The links' loads of one micro-batch's transfers after ``layer`` from a stage placed as ``src`` to one
        placed as ``dst`` (:class:`transfers.CommLinks` says what each number is)."""
        return self.comm_pair(src, dst)(layer)

    def comm_pair(self, src: ServerLayout, dst: ServerLayout) -> PairCosts:
        """``layer -> comm_links(layer, src, dst)``, with the gradients' ``ports`` (memoised per pair: the search
        asks one pair at many cuts)."""
        pair = self._comm.get((src, dst))
        if pair is None:  # costs see servers only as same-or-not: one CommPair per relabelling (first use order)
            label: dict = {}
            for s in src + dst:
                label.setdefault(s, len(label))
            key = (tuple(label[s] for s in src), tuple(label[s] for s in dst))
            canon = self._comm_canon.get(key)
            if canon is None:
                canon = self._comm_canon[key] = CommPair(self._micro_routes(len(src), len(dst)), *key,
                                                         self.route_times, self.cluster.link_sharing == "shared",
                                                         keep=len(label) <= tuning.TUNING.cached_servers)
            pair = self._comm[(src, dst)] = PairCosts(canon, list(label), self.num_layers)
        return pair

    def _micro_routes(self, senders: int, receivers: int) -> list:
        """The split-concat routes of one micro-batch from ``senders`` to ``receivers`` replicas (memoised)."""
        rs = self._routes.get((senders, receivers))
        if rs is None:
            rs = self._routes[(senders, receivers)] = routes(self.micro, senders, receivers)
        return rs

    def cached_pairs(self) -> int:
        """How many pairs of layouts :meth:`comm_pair` holds (a long search bounds its memory by this)."""
        return len(self._comm)

    def forget_comm(self) -> None:
        """Drop the memoised :meth:`comm_pair` tables (a long search bounds its memory with this)."""
        self._comm.clear()
        self._comm_canon.clear()

    def _boundary(self, rows: int) -> np.ndarray:
        """(N,): bytes crossing each cut for a slice of ``rows`` rows."""
        hit = self._bbytes.get(rows)
        if hit is None:
            # on the wire in the autocast dtype under mixed precision (half the bytes)
            hit = self._bbytes[rows] = np.asarray(self.profile.costs(rows).boundary_bytes,
                                                  dtype=float) * self.activation_scale
        return hit

    def link_periods(self, spans: Sequence[tuple[int, int, ServerLayout]]) -> LinkPeriods:
        """The least ms per micro-batch the links allow to the stages ``spans`` ((start, end, layout) each).

        In the steady phase a device link carries its stage's activations forward and gradients back (two
        communication stages) and a server's uplink and downlink every cross-server transfer of the plan in
        either direction; once activations have stopped (the drain) each link carries gradients alone: a device
        link one communication stage's, a server's uplink the gradients of what its downlink took forward.
        """
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
        return LinkPeriods(period, max([drain] + list(up.values()) + list(down.values())))

    # ---- AllReduce ---------------------------------------------------------------------------------
    def ring_allreduce_ms(self, nbytes: float, layout: ServerLayout) -> float:
        """Ring AllReduce: 2(r-1)/r * P / bw + 2(r-1) * latency over the slowest link the set spans."""
        return self._ring_ms(nbytes, len(layout), len(set(layout)) > 1)

    def _ring_ms(self, nbytes: float, replicas: int, spans_servers: bool) -> float:
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        share, bw, steps = self.ring_terms(replicas, spans_servers)
        return (share * nbytes / bw + steps) * 1e3

    def ring_terms(self, r: int, spans_servers: bool) -> RingTerms:
        """The terms of a ring AllReduce over ``r`` devices that do or do not span servers."""
        bw, lat = self.cluster.allreduce_link(spans_servers=spans_servers, replicas=r)
        return RingTerms(2 * (r - 1) / r, bw, 2 * (r - 1) * lat)

    def allreduce(self, a: int, c: int, layout: ServerLayout) -> float:
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
        share, bw, steps = self.ring_terms(replicas, spans_servers)
        pre = self.param_prefix
        p0 = pre[a]
        return [(share * (pre[c] - p0) / bw + steps) * 1e3 if pre[c] - p0 > 0 else 0.0 for c in range(a + 1, end)]

    def buckets(self, a: int, c: int) -> list[tuple[int, float]]:
        """Gradient buckets of layers [a, c) in backward order, by the runtime's rule (core.buckets): (lowest
        layer, bytes) each."""
        layers = [layer for layer in range(c - 1, a - 1, -1) if self.param_bytes[layer] > 0]
        groups = bucket([self.param_bytes[layer] for layer in layers], self.bucket_bytes)
        return [(layers[g[-1]], sum(self.param_bytes[layers[i]] for i in g)) for g in groups]

    def bucket_ready(self, a: int, c: int, rows: int, recompute: Recompute = False) -> list[tuple[float, float]]:
        """Per bucket of :meth:`buckets`: (ms from the start of the last backward of a ``rows``-row slice until
        it has produced the bucket's gradients, bytes). That backward runs layers c-1 .. a (after the call's own
        cost, and what a recomputing stage runs again first); a bucket is done after its lowest layer."""
        bsum = self.prefix_sums(rows).backward
        first = self.call_b + self.recompute_ms(a, c, rows, recompute)
        return [(bsum[c] - bsum[low] + first, nbytes) for low, nbytes in self.buckets(a, c)]

    def overlapped_ending(self, a: int, c: int, layout: ServerLayout, rows: int | None = None,
                          recompute: Recompute | None = None) -> float:
        """Ms from the start of the stage's last backward to the end of its AllReduce, when each bucket is
        reduced as soon as the last backward has produced it (DDP-style overlap); >= that backward's time
        (``recompute`` None: the model's own)."""
        rc = self.recompute if recompute is None else recompute
        rows = self.rows(len(layout)) if rows is None else rows
        _, b = self.compute_rows(a, c, rows, rc)
        if len(layout) <= 1:
            return b
        end = 0.0
        for ready, nbytes in self.bucket_ready(a, c, rows, rc):
            end = max(end, ready) + self.ring_allreduce_ms(nbytes, layout)
        return max(end, b)

    # ---- memory --------------------------------------------------------------------------------------
    def static_bytes(self, a: int, c: int, replicas: int = 1) -> float:
        """Parameters x optimizer factor (4: fp32 weights, gradients, Adam's two moments: 16 B/param) on each of
        ``replicas`` replicas: with ``shard_optimizer``, the optimizer's part divided among them."""
        return self.params(a, c) * self.static_factor(replicas)

    def static_factor(self, replicas: int) -> float:
        """Static bytes per parameter byte on each of ``replicas`` replicas (:func:`memory.static_factor`)."""
        return static_factor(self.optimizer_factor, replicas if self.shard_optimizer else 1)


def _prefix(values: Sequence[float]) -> list[float]:
    out, acc = [0.0], 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out
