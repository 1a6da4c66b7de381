"""What a traced run measured, set beside what the documents model: op times, runtime gaps, transfers, AllReduces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..core.timeline import Event, lane_of
from .traces import TracedRun, by_step

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..planner.simulator.events import SimResult

KINDS = ("F", "B", "W")  # forward, backward (split: input gradients), weight gradients
TINY_MS = 1e-6  # a modelled op this short is none (zb-h1's first stage runs its whole backward in W)


@dataclass(frozen=True)
class OpRatio:
    """Stage ``stage``'s ops of one kind in one step: measured over modelled time, its slowest replica's."""

    stage: int
    kind: str  # "F", "B" or "W"
    step: int
    ratio: float  # sum of measured / sum of modelled over the step's ops, on the stage's slowest replica
    ops: int  # ops it was measured on


@dataclass(frozen=True)
class Transfer:
    """One activation or gradient message: bytes and seconds from the send's post to its delivery."""

    link: str  # "intra" (same server) or "inter"
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class Reduction:
    """One step's gradient AllReduce of one group: its buckets (bytes, last launch over the members, s) in order,
    and when the last bucket completed (s)."""

    replicas: int
    spans_servers: bool
    buckets: tuple[tuple[float, float], ...]
    done: float


def op_kind(e: Event) -> str | None:
    """"F", "B" or "W" for a traced compute op, None for anything else."""
    if e.kind == "forward":
        return "F"
    if e.kind == "backward":
        return "W" if e.args.get("part") == "weight" else "B"
    return None


def modelled_ops(sim: "SimResult") -> dict[tuple[int, str], float]:
    """(device, kind) -> the simulator's ms of one such op on that device (every micro-batch's is the same)."""
    return {(o.device, o.kind): o.duration_ms for o in sim.ops if o.kind in KINDS}


def op_ratios(run: TracedRun, modelled: dict[tuple[int, str], float]) -> list[OpRatio]:
    """Per stage, kind and step: measured time over modelled time of the step's ops of that kind on the stage's
    slowest replica (a stage runs at the pace of its slowest replica): the replica whose ops of all kinds together
    took the longest against the model (a replica's jitter from op to op evens out over the step, as the
    pipeline's queues even it out; taking each kind's slowest replica apart would add up slow Fs of one replica and
    slow Bs of another)."""
    plan = run.plan
    sums: dict[tuple[int, int, int], dict[str, list[float]]] = {}  # (stage, step, rank) -> kind -> [meas, model, n]
    for e in run.events:
        kind = op_kind(e)
        if kind is None or e.micro_batch is None:
            continue
        model = modelled.get((e.rank, kind), 0.0)
        if model <= TINY_MS:
            continue
        step = cast(int, e.args.get("step"))  # a TracedRun keeps only events that hold their step
        acc = sums.setdefault((plan.stage_of_device(e.rank), step, e.rank), {}).setdefault(
            kind, [0.0, 0.0, 0])
        acc[0] += e.duration * 1e3
        acc[1] += model
        acc[2] += 1
    slowest: dict[tuple[int, int], tuple[float, dict[str, list[float]]]] = {}
    for (stage, step, _), kinds in sums.items():
        total = sum(m for m, _, _ in kinds.values()) / sum(m for _, m, _ in kinds.values())
        if (stage, step) not in slowest or total > slowest[(stage, step)][0]:
            slowest[(stage, step)] = (total, kinds)
    return [OpRatio(stage, kind, step, measured / model, int(n))  # n: the count, an int kept among floats
            for (stage, step), (_, kinds) in sorted(slowest.items()) for kind, (measured, model, n) in kinds.items()]


def step_overheads(run: TracedRun) -> list[float]:
    """Per step: ms of the step outside its work (every rank's F/B/W ops and its stages' gradient AllReduce), the
    fixed cost the runtime adds to a step: its checks before the first op, and after the last the loss AllReduce,
    tied parameters' AllReduce across stages (group "tied ...") and the last sends."""
    out = []
    for events in by_step(run.events).values():
        spans = [e for e in events if lane_of(e) == "step"]
        work = [e for e in events if op_kind(e) is not None or (e.name.startswith("AR bucket") and not str(
            e.args.get("group", "")).startswith("tied"))]
        if spans and work:
            span = max(e.end for e in spans) - min(e.start for e in spans)
            out.append(max(0.0, span - (max(e.end for e in work) - min(e.start for e in work))) * 1e3)
    return out


def gaps_per_op(run: TracedRun) -> list[float]:
    """Per rank and step: ms per F/B/W op of the runtime's own time that delays the pipeline, from the compute lane's
    uncovered time: before an op (it could have started: bookkeeping, time the process did not run) and after it
    until its sends are posted (its messages leave that much later). Uncovered time before a wait is left out: the
    rank would have waited for its message anyway."""
    out = []
    for events in by_step(run.events).values():
        lanes: dict[int, list[Event]] = {}
        sends: dict[int, list[Event]] = {}
        for e in events:
            if lane_of(e) == "compute":
                lanes.setdefault(e.rank, []).append(e)
            elif e.kind == "send":
                sends.setdefault(e.rank, []).append(e)
        for rank, lane in lanes.items():
            lane.sort(key=lambda e: e.start)
            ops = [i for i, e in enumerate(lane) if op_kind(e) is not None]
            if not ops:
                continue
            gap = 0.0
            for i in ops:
                e = lane[i]
                if i > 0:  # before the op
                    gap += max(0.0, e.start - max(x.end for x in lane[:i]))
                until = lane[i + 1].start if i + 1 < len(lane) else e.end
                posted = [s.end for s in sends.get(rank, ()) if e.end <= s.start <= until]
                if posted and i + 1 < len(lane) and op_kind(lane[i + 1]) is None:  # after it, to its sends posted
                    gap += max(0.0, min(max(posted), until) - e.end)
            out.append(gap * 1e3 / len(ops))
    return out


def transfers(run: TracedRun, cluster: "Cluster") -> list[Transfer]:
    """Messages whose receiver was already waiting when the sender posted it: from the post to the end of the
    wait is then the transfer itself. A receive waited for later may have arrived long before, so its wait says
    nothing of the link; a send's own span is only the non-blocking post."""
    sends: dict[tuple[Any, ...], Event] = {
        (e.rank, e.args.get("peer"), e.args.get("what"), e.micro_batch, e.args.get("step"),
         tuple(e.args.get("rows", ()))): e for e in run.events if e.kind == "send"}
    out = []
    for e in run.events:
        if e.kind != "recv":
            continue
        src = e.args.get("peer")
        s = sends.get((src, e.rank, e.args.get("what"), e.micro_batch, e.args.get("step"),
                       tuple(e.args.get("rows", ()))))
        if s is None or e.start > s.start or e.end <= s.start:
            continue
        link = "intra" if cluster.server_of(s.rank) == cluster.server_of(e.rank) else "inter"  # s.rank == src
        out.append(Transfer(link, float(e.args.get("bytes", 0)), e.end - s.start))
    return out


def reductions(run: TracedRun, cluster: "Cluster") -> list[Reduction]:
    """Each step's gradient AllReduce per group: its buckets in launch order with their last launch over the
    members, and the last bucket's completion (the latest a member saw; every member waits for the last bucket,
    which the slowest member launches last, so that one is seen as it happens: earlier buckets' ends are only
    when a member next looked)."""
    # the cost model prices the gradients' own bytes (fp32), the runtime's bytes are the wire's: a reduce_dtype of
    # half the width moved half of them
    wire = 2.0 if run.plan.reduce_dtype in ("bf16", "fp16") else 1.0
    out = []
    for events in by_step(run.events).values():
        groups: dict[tuple, dict[int, list[Event]]] = {}
        for e in events:
            if e.kind == "allreduce" and e.name.startswith("AR bucket"):
                key = (e.args.get("group"), tuple(e.args.get("ranks", ())))
                groups.setdefault(key, {}).setdefault(int(e.name.rsplit(" ", 1)[1]), []).append(e)
        for (_, ranks), buckets in groups.items():
            if len(ranks) < 2:
                continue
            order = [buckets[k] for k in sorted(buckets)]
            launched = tuple((float(es[0].args.get("bytes", 0)) * wire, max(e.start for e in es)) for es in order)
            out.append(Reduction(len(ranks), len(cluster.servers_of(ranks)) > 1, launched,
                                 max(e.end for e in order[-1])))
    return out
