"""Event simulator of one training iteration: the runtime's per-stage op order, links as resources, AllReduce."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, cast

from ...core.buckets import BUCKET_BYTES
from ...core.checks import flag
from ...core.chunk_schedule import ChunkOp, peak_held, rank_ops
from ...core.cluster import LINK_SHARING
from ...core.plan import Plan, check_fit
from ...core.schedule import CHUNKED_SCHEDULES, SPLIT_BACKWARD, Op, pipeline_stage_ops
from ...core.split_concat import routes, slice_bounds
from ...core.timeline import Event, lane_of
from ..checks import instance, profile_and_cluster
from ..model.cost import CostModel, layout_of
from ..model.transfers import route_links
from .links import SharedLinks
from .split import split_backward

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

COMPUTE_KINDS = ("F", "B", "W")


@dataclass
class TimelineOp:
    """One interval on a device: a forward/backward ("F"/"B"; split backward: "B" input and "W" weight
    gradients), an AllReduce bucket ("AR"), or a transfer
    ("send_F" activations / "send_B" gradients, on the sender's timeline, ``peer`` = the receiving device)."""

    device: int
    stage: int
    kind: str
    micro_batch: int | None
    start_ms: float
    end_ms: float
    peer: int | None = None
    rows: int = 0
    nbytes: float = 0.0

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class SimResult:
    """What :func:`simulate` found: the iteration latency and every interval, ready for a Gantt chart."""

    latency_ms: float
    ops: list[TimelineOp]  # compute and AllReduce, per device
    transfers: list[TimelineOp]  # split-concat transfers (on the sender's timeline)
    schedule: str
    overlap: bool
    num_micro_batches: int
    stage_of_device: dict[int, int] = field(default_factory=dict)  # a device of several chunks: its first stage
    link_sharing: str = "held"  # transfers hold their links whole, or share them ("shared")
    stages_of_device: dict[int, list[int]] = field(default_factory=dict)  # every stage (chunk) of each device

    def device_timeline(self, device: int) -> list[TimelineOp]:
        """Compute and AllReduce intervals of one device, in time order."""
        return sorted((o for o in self.ops if o.device == device), key=lambda o: (o.start_ms, o.end_ms))

    def max_alive(self, device: int) -> int:
        """Most micro-batches whose forward ran on ``device`` and whose backward had not (activations held; split
        backward: until their W), every chunk's counted."""
        return int(peak_held([ChunkOp(o.kind, o.micro_batch, o.stage) for o in self.device_timeline(device)
                              if o.kind in COMPUTE_KINDS and o.micro_batch is not None]))  # (compute: all have one)

    def busy_fraction(self) -> float:
        """Share of device time spent in forward/backward compute."""
        busy = sum(o.duration_ms for o in self.ops if o.kind in COMPUTE_KINDS)
        return busy / (self.latency_ms * max(1, len(self.stage_of_device))) if self.latency_ms > 0 else 0.0

    def __str__(self) -> str:
        return (f"simulated {self.schedule} iteration: {self.latency_ms:.3f} ms over {len(self.stage_of_device)} "
                f"device(s), {self.num_micro_batches} micro-batches, bubble fraction "
                f"{1 - self.busy_fraction():.1%}"
                f"{', AllReduce overlapped with the last backward' if self.overlap else ''}"
                f"{', transfers sharing links' if self.link_sharing == 'shared' else ''}")


def simulate(plan: "Plan", profile: "Profile", cluster: "Cluster", *, overlap: bool | None = None,
             schedule: str | None = None, bucket_bytes: float = BUCKET_BYTES,
             link_sharing: str | None = None) -> SimResult:
    """Play ``plan``'s iteration (any Plan: DAPPLE's, PipeDream's, ...) event by event.

    Each device runs ``pipeline_stage_ops`` of its stage (the runtime's order) on its slice of every micro-batch
    (a split backward: W the weight-gradient share of the backward, as profiled, else ``split.WEIGHT_SHARE``, B the
    rest; on the first stage, which has no input gradients to compute, B takes no time and W the whole backward);
    split-concat transfers (``core.split_concat.routes``) occupy the directed links of ``Cluster.graph()``
    they cross (sender/receiver device links, server up/downlinks), start in order of readiness and overlap
    with compute; each replicated stage AllReduces its gradients after its last backward. AllReduce does not
    contend with transfers.
    The plan's ``mixed_precision`` puts activations and their gradients on the wire in half the bytes (the
    AllReduce stays fp32); a recomputing stage (``Stage.recompute``) runs its forward again before each backward.

    Args:
        plan, profile, cluster: what runs, its layers' costs, and where.
        overlap: AllReduce bucket by bucket as the last backward produces them, like DDP (default: as the plan
            was made, ``plan.meta["overlap"]``, else False).
        schedule: the plan's own by default.
        bucket_bytes: the gradient bucket size of the overlapped AllReduce.
        link_sharing: (default: ``cluster.link_sharing``) "held": a transfer holds all its links for its whole
            duration, one transfer per link at a time, started as soon as all its links are free; "shared": a
            transfer starts once the earlier one between the same two devices in its direction is done (the
            runtime's forward and backward process groups each keep their sends in order) and shares each
            link max-min fairly with the others in flight (:class:`links.SharedLinks`).

    Raises:
        ValueError: bad input, a plan that does not fit the profile or cluster, or a schedule that deadlocks.
    """
    instance("simulate", "plan", plan, Plan)
    profile_and_cluster("simulate", profile, cluster)
    overlap = bool(plan.meta.get("overlap", False)) if overlap is None else overlap
    flag("overlap", overlap)
    link_sharing = cluster.link_sharing if link_sharing is None else link_sharing
    if link_sharing not in LINK_SHARING:
        raise ValueError(f"link_sharing: expected one of {LINK_SHARING}, got {link_sharing!r}")
    schedule = schedule or plan.schedule
    if (schedule in CHUNKED_SCHEDULES) != (plan.schedule in CHUNKED_SCHEDULES):
        raise ValueError(f"schedule: {schedule!r} cannot run the plan's stages, made for {plan.schedule!r} (one runs "
                         f"several chunks per device group, the other one stage)")
    check_fit(plan.stages, profile.num_layers, cluster.num_devices, "simulate")
    plan.check_layers(profile.layer_names, f"the profile of {profile.model}")
    cm = CostModel(profile, cluster, plan.micro_batch_size, bucket_bytes=bucket_bytes,
                   mixed_precision=plan.mixed_precision)
    return _Sim(plan, cm, cluster, schedule, overlap, link_sharing == "shared").run()


class Deadlock(ValueError):
    """The plan's op orders wait on each other: some device never runs its next op."""


class _Pending(NamedTuple):
    """A transfer that is ready and waits for its links (held) or its pair's earlier transfer (shared)."""

    seq: int  # readiness order
    src: int  # sending device
    dst: int  # receiving device
    kind: str  # "F" activations or "B" gradients
    mb: int  # micro-batch
    layer: int  # the cut it crosses: after this layer
    rows: int
    links: tuple  # transfers.route_links
    src_server: int
    dst_server: int
    stage: int  # the sending stage (the receiving one: the next for "F", the one before for "B")


class _Arrival(NamedTuple):
    """A transfer's end: stage ``stage`` on ``dst`` has one more of the ``kind`` tensors of micro-batch ``mb``,
    ``links`` are free."""

    dst: int
    kind: str
    mb: int
    links: tuple
    stage: int


class _Sim:
    """One simulated iteration: devices, their op pointers, the links, and the event queue."""

    def __init__(self, plan: "Plan", cm: CostModel, cluster: "Cluster", schedule: str, overlap: bool,
                 shared: bool = False):
        self.plan, self.cm, self.cluster, self.schedule, self.overlap = plan, cm, cluster, schedule, overlap
        self.net = SharedLinks() if shared else None
        self.streams: set = set()  # (sender, receiver, kind) with a transfer in flight (shared links)
        self.M, self.S, b = plan.num_micro_batches, plan.num_stages, plan.micro_batch_size
        self.rows = [[e - s for s, e in slice_bounds(b, st.replicas)] for st in plan.stages]
        # routes between stage i and i+1: (sender replica, receiver replica, rows)
        self.routes = [routes(b, plan.stages[i].replicas, plan.stages[i + 1].replicas) for i in range(self.S - 1)]
        self.need_f = [[0] * st.replicas for st in plan.stages]  # incoming activation transfers per replica
        self.need_b = [[0] * st.replicas for st in plan.stages]  # incoming gradient transfers per replica
        for i, rs in enumerate(self.routes):
            for r in rs:
                self.need_f[i + 1][r.dst] += 1
                self.need_b[i][r.src] += 1
        self.ops = device_ops(plan, schedule)  # per device: (stage, op) in the runtime's order
        self.split = schedule in SPLIT_BACKWARD
        # the op whose run for the last micro-batch makes a stage's gradients final (a recomputing stage runs its
        # whole backward in B under a split schedule too)
        self.grad_kind = ["W" if self.split and not st.recompute else "B" for st in plan.stages]
        self.shares: dict[tuple[int, int], float | None] = {}  # (stage, replica) -> profiled weight share
        self.replica = {d: k for st in plan.stages for k, d in enumerate(st.devices)}  # (every chunk: the same)
        self.stages_of = {d: sorted({i for i, _ in ops}) for d, ops in self.ops.items()}
        self.ptr = {d: 0 for d in self.ops}
        self.busy = {d: False for d in self.ops}
        self.arrived: dict[tuple, int] = {}  # (device, stage, kind, micro_batch) -> transfers arrived
        self.link_busy: set = set()
        self.waiting: list = []  # ready transfers waiting for a busy link
        self.blocked = 0  # waiting[:blocked] found their links busy at the last dispatch (held links)
        self.freed = False  # a held link freed since then: they are looked at again
        self.events: list = []
        self.seq = 0
        self.timeline: list[TimelineOp] = []
        self.transfers: list[TimelineOp] = []
        self.last_b_start: dict[tuple[int, int], float] = {}  # (device, stage) -> start of its last B (or W)
        self.done_at: dict[int, float] = {}

    def push(self, t: float, kind: str, payload: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def duration(self, d: int, i: int, kind: str) -> float:
        k = self.replica[d]
        a, c = self.plan.stages[i].layers
        f, b = self.cm.compute_rows(a, c, self.rows[i][k], self.plan.stages[i].recompute)
        if kind == "F":
            return f
        if not self.split:
            return b
        if self.plan.stages[i].recompute:  # the runtime runs a recomputed stage's whole backward in B
            return b if kind == "B" else 0.0
        return split_backward(i, b, self.share(i, k))[kind == "W"]

    def share(self, i: int, k: int) -> float | None:
        """Replica k of stage i: the weight-gradient share of its backward, as profiled (None: not measured)."""
        if (i, k) not in self.shares:
            a, c = self.plan.stages[i].layers
            self.shares[(i, k)] = self.cm.profile.weight_share(a, c, self.rows[i][k])
        return self.shares[(i, k)]

    def ready(self, d: int) -> bool:
        i, op = self.ops[d][self.ptr[d]]
        k = self.replica[d]
        if op.kind == "F":
            return i == 0 or self.arrived.get((d, i, "F", op.micro_batch), 0) >= self.need_f[i][k]
        if op.kind == "W":  # after its own B, earlier in the device's order
            return True
        return i == self.S - 1 or self.arrived.get((d, i, "B", op.micro_batch), 0) >= self.need_b[i][k]

    def try_start(self, d: int, t: float) -> None:
        if self.busy[d] or self.ptr[d] >= len(self.ops[d]) or not self.ready(d):
            return
        i, op = self.ops[d][self.ptr[d]]
        k = self.replica[d]
        end = t + self.duration(d, i, op.kind)
        self.busy[d] = True
        if op.kind == self.grad_kind[i] and op.micro_batch == self.M - 1:
            self.last_b_start[(d, i)] = t
        self.timeline.append(TimelineOp(d, i, op.kind, op.micro_batch, t, end, rows=self.rows[i][k]))
        self.push(end, "op", (d,))

    def send(self, src: int, dst: int, kind: str, mb: int, layer: int, rows: int, stage: int) -> None:
        if src == dst:  # between two chunks of one device: there at once, on no link
            to = stage + 1 if kind == "F" else stage - 1
            self.arrived[(dst, to, kind, mb)] = self.arrived.get((dst, to, kind, mb), 0) + 1
            return
        si, ti = self.cluster.server_of(src), self.cluster.server_of(dst)
        self.seq += 1
        self.waiting.append(_Pending(self.seq, src, dst, kind, mb, layer, rows, route_links(src, dst, si, ti), si, ti,
                                     stage))

    def dispatch(self, t: float) -> None:
        """Start every waiting transfer whose links are all free, in order of readiness (a transfer that
        waits for a busy link holds nothing meanwhile); shared links: every one whose pair has none in flight."""
        # held links: one blocked at the last dispatch stays blocked until a link frees
        skip = self.blocked if self.net is None and not self.freed else 0
        still = self.waiting[:skip]
        for item in self.waiting[skip:]:
            seq, src, dst, kind, _, layer, rows, links, si, ti, _ = item
            if self.net is not None:  # shared links: on its way at once, after the pair's earlier transfers
                if (src, dst, kind) in self.streams:
                    still.append(item)
                    continue
                self.streams.add((src, dst, kind))
                self.net.add(t, seq, self.cm.route_ms(layer, rows, si, ti), links, (t, item))
                continue
            if not self.link_busy.isdisjoint(links):
                still.append(item)
                continue
            self.link_busy.update(links)
            end = t + self.cm.route_ms(layer, rows, si, ti)
            self.record(item, t, end)
            self.push(end, "xfer", _Arrival(dst, kind, item.mb, links, _receiver(item)))
        self.waiting = still
        self.blocked, self.freed = len(still), False

    def record(self, item: _Pending, start: float, end: float) -> None:
        nbytes = self.cm.profile.costs(item.rows).boundary_bytes[item.layer] * self.cm.activation_scale
        self.transfers.append(TimelineOp(item.src, item.stage, "send_" + item.kind, item.mb, start, end,
                                         item.dst, item.rows, nbytes))

    def finish(self, d: int, t: float) -> None:
        i, op = self.ops[d][self.ptr[d]]
        self.ptr[d] += 1
        self.busy[d] = False
        k = self.replica[d]
        st = self.plan.stages
        if op.kind == "F" and i < self.S - 1:
            for r in self.routes[i]:
                if r.src == k:
                    self.send(d, st[i + 1].devices[r.dst], "F", op.micro_batch, st[i].layers[1] - 1, r.rows, i)
        if op.kind == "B" and i > 0:
            for r in self.routes[i - 1]:
                if r.dst == k:
                    self.send(d, st[i - 1].devices[r.src], "B", op.micro_batch, st[i - 1].layers[1] - 1, r.rows, i)
        if self.ptr[d] == len(self.ops[d]):
            self.done_at[d] = t
        self.try_start(d, t)
        self.dispatch(t)

    def allreduce(self) -> None:
        for i, st in enumerate(self.plan.stages):
            if st.replicas <= 1:
                continue
            chunks = self.stages_of[st.devices[0]]
            if len(chunks) > 1:  # a device group's chunks: one AllReduce of all their gradients, by its first chunk
                if i == chunks[0]:
                    self.chunk_allreduce(chunks)
                continue
            a, c = st.layers
            if not self.overlap:
                t0 = max(self.done_at[d] for d in st.devices)
                steps = [(t0, self.cm.params(a, c))]
            else:  # bucket ready when every replica's last backward has produced it
                per = [self.bucket_ready(i, a, c, self.rows[i][k]) for k in range(len(st.devices))]  # per replica
                steps = []
                for n, (_, nbytes) in enumerate(per[0]):
                    steps.append((max(self.last_b_start[(d, i)] + per[k][n][0] for k, d in enumerate(st.devices)),
                                  nbytes))
            self.play_allreduce(i, st.devices, steps)

    def chunk_allreduce(self, chunks: list[int]) -> None:
        """The AllReduce of a device group's chunks (the runtime's buckets hold them all, the last chunk's first):
        once every replica is done, or (overlap) bucket by bucket as each chunk's last backward makes them."""
        devices = self.plan.stages[chunks[0]].devices
        if not self.overlap:
            t0 = max(self.done_at[d] for d in devices)
            steps = [(t0, sum(self.cm.params(*self.plan.stages[i].layers) for i in chunks))]
        else:
            steps = []
            for i in reversed(chunks):
                a, c = self.plan.stages[i].layers
                per = [self.bucket_ready(i, a, c, self.rows[i][k]) for k in range(len(devices))]
                steps += [(max(self.last_b_start[(d, i)] + per[k][n][0] for k, d in enumerate(devices)), nbytes)
                          for n, (_, nbytes) in enumerate(per[0])]
        self.play_allreduce(chunks[0], devices, steps)

    def play_allreduce(self, i: int, devices: list[int], steps: list[tuple[float, float]]) -> None:
        """Buckets (ready ms, bytes) one after another on ``devices``' ring, drawn under stage ``i``."""
        layout = layout_of(self.cluster, devices)
        end = 0.0
        for ready, nbytes in steps:
            start = max(end, ready)
            end = start + self.cm.ring_allreduce_ms(nbytes, layout)
            for d in devices:
                self.timeline.append(TimelineOp(d, i, "AR", None, start, end, nbytes=nbytes))

    def bucket_ready(self, stage: int, a: int, c: int, rows: int) -> list[tuple[float, float]]:
        """CostModel.bucket_ready from the start of the op that makes the stage's gradients final (split: its last
        W, which runs the weight share of each layer's backward)."""
        recompute = self.plan.stages[stage].recompute
        ready = self.cm.bucket_ready(a, c, rows, recompute)
        if self.grad_kind[stage] != "W":
            return ready
        share = split_backward(stage, 1.0, self.cm.profile.weight_share(a, c, rows))[1]
        return [(t * share, nbytes) for t, nbytes in ready]

    def run(self) -> SimResult:
        for d in self.ops:
            self.try_start(d, 0.0)
        net = self.net
        while self.events or (net is not None and net.flows):
            done = net.next_done() if net is not None else None
            if done is not None and net is not None and (not self.events or done[0] <= self.events[0][0]):
                start, item = cast("tuple[float, _Pending]", net.finish(*done))  # the payload send() added
                self.streams.discard((item.src, item.dst, item.kind))
                self.record(item, start, done[0])
                t, kind, payload = done[0], "xfer", _Arrival(item.dst, item.kind, item.mb, item.links, _receiver(item))
            else:
                t, _, kind, payload = heapq.heappop(self.events)
            if kind == "op":
                self.finish(payload[0], t)
            else:
                d, k, mb, links, i = payload
                self.link_busy.difference_update(links)
                self.freed = True
                self.arrived[(d, i, k, mb)] = self.arrived.get((d, i, k, mb), 0) + 1
                self.try_start(d, t)
                self.dispatch(t)
        stuck = [d for d in self.ops if self.ptr[d] < len(self.ops[d])]
        if stuck:
            d = stuck[0]
            i, op = self.ops[d][self.ptr[d]]
            raise Deadlock(f"schedule deadlocks: device {d} (stage {i}) waits forever at {op}; warmup "
                           f"{self.plan.warmup}")
        self.allreduce()
        latency = max([o.end_ms for o in self.timeline] + [o.end_ms for o in self.transfers] + [0.0])
        latency += self.cm.profile.step_ms  # the step's own fixed cost (Profile.step_ms), after its last op
        return SimResult(latency, self.timeline, self.transfers, self.schedule, self.overlap, self.M,
                         {d: ss[0] for d, ss in self.stages_of.items()}, "held" if self.net is None else "shared",
                         dict(self.stages_of))


def _receiver(item: _Pending) -> int:
    """The stage a transfer goes to: the next for activations, the one before for gradients."""
    return item.stage + 1 if item.kind == "F" else item.stage - 1


def device_ops(plan: Plan, schedule: str) -> dict[int, list[tuple[int, Op | ChunkOp]]]:
    """Each device's (stage, op) in the runtime's order under ``schedule``: its stage's ``pipeline_stage_ops``, or
    its device group's chunks in ``core.chunk_schedule.rank_ops``'s order."""
    if schedule in CHUNKED_SCHEDULES:
        layout = plan.chunks
        groups = [rank_ops(schedule, plan.num_micro_batches, len(layout.groups), layout.chunks, g)
                  for g in range(len(layout.groups))]
        return {d: [(op.stage, op) for op in groups[g]] for g, ds in enumerate(layout.groups) for d in ds}
    return {d: [(i, op) for op in pipeline_stage_ops(schedule, plan.num_micro_batches, plan.warmup, i)]
            for i, st in enumerate(plan.stages) for d in st.devices}


def from_simulation(sim: SimResult) -> list[Event]:
    """The simulator's timeline as events (times in s from 0), drawn like a measured trace: compute with the
    idle gaps between ops, transfers as a send on the sender and a receive on the receiver, AllReduce at the
    end (or, overlapped, bucket by bucket in the transfer lane)."""
    names = {"F": ("forward", "F"), "B": ("backward", "B"), "W": ("backward", "W")}  # W: kind backward, named W
    out: list[Event] = []
    for o in sim.ops:
        if o.kind in names:
            kind, letter = names[o.kind]
            args = {"stage": o.stage, "rows": o.rows, **({"part": "weight"} if o.kind == "W" else {})}
            out.append(Event(o.device, kind, f"{letter}{o.micro_batch}", o.start_ms / 1e3, o.end_ms / 1e3,
                             o.micro_batch, args))
        elif o.kind == "AR":
            lane = "allreduce" if sim.overlap else "compute"
            out.append(Event(o.device, "allreduce", "AR", o.start_ms / 1e3, o.end_ms / 1e3, None,
                             {"stage": o.stage, "bytes": o.nbytes, "lane": lane}))
    for tr in sim.transfers:
        what = "activations" if tr.kind == "send_F" else "gradients"
        args = {"bytes": tr.nbytes, "rows": tr.rows, "what": what}
        if tr.peer is None:
            raise ValueError(f"from_simulation: a transfer without its receiver: {tr}")
        out.append(Event(tr.device, "send", f"send→{tr.peer}", tr.start_ms / 1e3, tr.end_ms / 1e3, tr.micro_batch,
                         {**args, "peer": tr.peer}))
        out.append(Event(tr.peer, "recv", f"recv←{tr.device}", tr.start_ms / 1e3, tr.end_ms / 1e3, tr.micro_batch,
                         {**args, "peer": tr.device}))
    for d in sorted(sim.stage_of_device):  # the gaps of each device's compute lane, as in measured traces
        busy = sorted((e for e in out if e.rank == d and lane_of(e) == "compute"), key=lambda e: e.start)
        t = 0.0
        for e in busy:
            if e.start > t + 1e-9:
                out.append(Event(d, "idle", "idle", t, e.start))
            t = max(t, e.end)
    return out
