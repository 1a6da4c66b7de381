"""``evaluate``: the latency model (paper formula 2, or the refined model) of ANY given stages, as an Estimate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ...core.checks import positive_int
from ...core.plan import Estimate, Plan, Stage, check_fit, check_stages
from ...core.schedule import SCHEDULES, WARMUP_POLICIES, validate_warmup, warmup_counts
from ..checks import profile_and_cluster
from .cost import CostModel, ServerLayout, layout_of
from .memory import check_stage_memory, slices_that_fit
from .pivot import Latency, paper_latency
from .refined import refined_latency
from .transfers import add_users, feeds, queues

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile

MODELS = ("paper", "refined")


@dataclass
class PipelineCosts:
    """Per-stage costs of a plan, interleaved (compute 2i, communication 2i+1), in ms, ready for a model."""

    F: list[float]
    B: list[float]
    AR: list[float]  # 0 for communication stages and single replicas
    E: list[float]  # last backward + overlapped AllReduce (DDP-style), per interleaved stage (B for comm)
    K: list[int]  # warmup K_i per compute stage
    M: int
    link_period: float = 0.0  # least steady ms per micro-batch the links allow (CostModel.link_periods)
    chain: list | None = None  # B, with the gradients' share of a round trip for communication stages
    window: list | None = None  # the same in the steady state (CostModel.comm_links)
    drain_period: float | None = None  # the same once activations stop: gradients alone (default link_period)
    queue: list | None = None  # per compute stage: its first gradient queues behind its activations (comm.queues)
    feed: list | None = None  # per stage: the warmup's floor where server links carry several stages (comm.feeds)

    def latency(self, model: str = "paper", overlap: bool = False) -> Latency:
        if model == "paper":
            return paper_latency(self.F, self.B, self.AR, self.M)
        return refined_latency(self.F, self.B, self.AR, self.E if overlap else None, self.K, self.M,
                               self.link_period, self.chain, self.window, self.drain_period, self.queue,
                               self.feed)


def stage_list(stages: Sequence, num_layers: int, cluster: "Cluster", micro_batch_size: int) -> list[Stage]:
    """``stages`` as Stage objects: (layer_start, layer_end_exclusive, [devices]) tuples or Stages; validated."""
    if isinstance(stages, Plan):
        stages = stages.stages
    if not isinstance(stages, (list, tuple)) or not stages:
        raise ValueError(f"stages: expected a non-empty list of (layer_start, layer_end, [device ids]) or Stage, "
                         f"got {stages!r:.120}")
    out = []
    for i, s in enumerate(stages):
        if isinstance(s, Stage):
            out.append(Stage(s.layers, s.devices, s.warmup))
        elif isinstance(s, (list, tuple)) and len(s) in (3, 4):
            out.append(Stage((s[0], s[1]), list(s[2]), s[3] if len(s) == 4 else None))
        else:
            raise ValueError(f"stages[{i}]: expected (layer_start, layer_end, [device ids]) or a Stage, got {s!r:.120}")
    check_stages(out, micro_batch_size, "evaluate")
    check_fit(out, num_layers, cluster.num_devices, "evaluate")
    return out


def pipeline_costs(cm: CostModel, spans: Sequence[tuple[int, int, ServerLayout]], M: int, policy: str = "A",
                   warmup: Sequence[int] | None = None, check: bool = True,
                   endings: bool = True) -> tuple[PipelineCosts, list[int]]:
    """Interleaved costs of stages ``(a, c, layout)`` and D per stage (paper V-C); raises ValueError when a
    stage does not fit in device memory (``check``). ``endings``: E, the overlapped AllReduce's ending of each
    stage (False: E = B, for a caller that prices no overlap)."""
    F, B, AR, E, D, chain, window, queue = [], [], [], [], [], [], [], []
    hot: tuple = ()  # the busiest inbound links of stage i (comm.queues), from the transfer into it
    users: dict = {}  # per server, the communication stages on its uplink and downlink (comm.feeds)
    mem = cm.cluster.device_memory
    for i, (a, c, lay) in enumerate(spans):
        f, b = cm.compute(a, c, len(lay))
        d = slices_that_fit(cm.static_bytes(a, c), cm.saved_bytes(a, c, len(lay)), mem)
        if d < 1 and check:
            check_stage_memory(i, cm.static_bytes(a, c), cm.saved_bytes(a, c, len(lay)), mem)
        D.append(d)
        F.append(f)
        B.append(b)
        chain.append(b)
        window.append(b)
        AR.append(cm.allreduce(a, c, lay))
        E.append(cm.overlapped_ending(a, c, lay) if endings else b)
        if i + 1 < len(spans):
            pair = cm.comm_pair(lay, spans[i + 1][2])
            queue.append(queues(hot, pair.ports))
            cl = pair(c - 1)
            cf = cb = cl[0]
            F.append(cf)
            B.append(cb)
            chain.append(cl[4])
            window.append(cl[5])
            hot = cl[6]
            users = add_users(users, cl[3], 2 * i + 1)
            AR.append(0.0)
            E.append(cb)
    if warmup is None:
        K = warmup_counts(len(spans), M, policy, max_in_flight=[max(1, d) for d in D])
    else:
        K = [int(k) for k in warmup]
        if check:
            for i, (a, c, lay) in enumerate(spans):
                if K[i] > D[i]:
                    check_stage_memory(i, cm.static_bytes(a, c), cm.saved_bytes(a, c, len(lay)), mem, K[i])
    period, drain = cm.link_periods(spans)
    queue.append(False)  # the last stage: no gradients from below
    return PipelineCosts(F, B, AR, E, K, M, period, chain, window, drain, queue, feeds(users, len(F))), D


def evaluate(profile: "Profile", cluster: "Cluster", stages: Sequence, global_batch_size: int | None = None,
             micro_batch_size: int | None = None, *, schedule: str | None = None, warmup_policy: str | None = None,
             optimizer_factor: float = 4.0, model: str | None = None, overlap: bool | None = None) -> Estimate:
    """Latency of one iteration of ``stages`` (formula 2 with the pivot of Algorithm 1 for ``model="paper"``,
    the refined model of :mod:`dapple.planner.model.refined` for ``model="refined"``), with per-stage costs in
    ``details``. ``stages``: (layer_start, layer_end_exclusive, [device ids]) tuples, Stages (their warmup
    K_i is used if every stage gives one), or a Plan. Defaults: schedule "dapple", warmup policy "A" (K_i when
    the stages give none), model "paper", no overlap; for a Plan its own batch sizes, schedule, policy, and
    the latency model and overlap it was planned with (``plan.meta``), so that
    ``evaluate(profile, cluster, plan)`` reproduces ``plan.estimate``.
    Raises ValueError for bad input or a plan that does not fit in device memory, naming the stage.
    """
    profile_and_cluster("evaluate", profile, cluster)
    if isinstance(stages, Plan):
        stages.check_layers(profile.layer_names, f"the profile of {profile.model}")
        global_batch_size = global_batch_size or stages.global_batch_size
        micro_batch_size = micro_batch_size or stages.micro_batch_size
        schedule = schedule or stages.schedule
        warmup_policy = warmup_policy or stages.warmup_policy
        model = model or stages.meta.get("latency_model")
        overlap = stages.meta.get("overlap") if overlap is None else overlap
    schedule, warmup_policy, model = schedule or "dapple", warmup_policy or "A", model or "paper"
    overlap = bool(overlap)
    g, b = global_batch_size, micro_batch_size
    positive_int("global_batch_size", g)
    positive_int("micro_batch_size", b)
    if g % b:
        raise ValueError(f"global_batch_size {g} is not divisible by micro_batch_size {b}")
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if warmup_policy not in WARMUP_POLICIES:
        raise ValueError(f"warmup_policy: expected one of {WARMUP_POLICIES}, got {warmup_policy!r}")
    sts = stage_list(stages, profile.num_layers, cluster, b)
    M = g // b
    given = [s.warmup for s in sts]
    if any(k is not None for k in given) and not all(k is not None for k in given):
        raise ValueError(f"stages: give warmup K_i for every stage or for none, got {given}")
    if schedule == "gpipe":
        given = [M] * len(sts)  # gpipe holds every micro-batch's activations
    elif given[0] is not None:
        validate_warmup(given, M)
    else:
        given = None
    cm = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor)
    spans = [(s.layers[0], s.layers[1], layout_of(cluster, s.devices)) for s in sts]
    pc, D = pipeline_costs(cm, spans, M, warmup_policy, given)
    lat = pc.latency(model, overlap)
    return make_estimate(cm, spans, pc, D, lat, model=model, overlap=overlap, schedule=schedule)


def make_estimate(cm: CostModel, spans: Sequence[tuple[int, int, ServerLayout]], pc: PipelineCosts, D: Sequence[int],
                  lat: Latency, *, model: str, overlap: bool, schedule: str) -> Estimate:
    """An Estimate with ``details``: per-stage F/B/AR/comm/K_i/D/memory, bubble fraction, ACR, pivot."""
    n = len(spans)
    per = []
    busy = 0.0
    for i, (a, c, lay) in enumerate(spans):
        k = pc.K[i]
        busy += len(lay) * pc.M * (pc.F[2 * i] + pc.B[2 * i])
        d = {"layers": [a, c], "replicas": len(lay), "rows": cm.rows(len(lay)),
             "forward_ms": round(pc.F[2 * i], 6), "backward_ms": round(pc.B[2 * i], 6),
             "allreduce_ms": round(pc.AR[2 * i], 6), "warmup": k, "max_in_flight": int(min(D[i], 1 << 20)),
             "memory_gb": round((cm.static_bytes(a, c) + k * cm.saved_bytes(a, c, len(lay))) / 1e9, 4)}
        if overlap and len(lay) > 1:
            d["overlapped_ending_ms"] = round(pc.E[2 * i], 6)
        if i + 1 < n:
            d["send_forward_ms"] = round(pc.F[2 * i + 1], 6)
            d["send_backward_ms"] = round(pc.B[2 * i + 1], 6)
        per.append(d)
    devices = sum(len(lay) for _, _, lay in spans)
    comm = [pc.F[j] + pc.B[j] for j in range(1, len(pc.F), 2)]
    compute = [pc.F[j] + pc.B[j] for j in range(0, len(pc.F), 2)]
    acr = (sum(comm) / len(comm)) / (sum(compute) / len(compute)) if comm and sum(compute) > 0 else 0.0
    q = lat.pivot
    details = {"model": model, "schedule": schedule, "overlap": overlap, "num_micro_batches": pc.M,
               "stages": per, "bubble_fraction": round(max(0.0, 1 - busy / (devices * lat.total)), 6)
               if lat.total > 0 else 0.0, "acr": round(acr, 6),
               "pivot": f"stage {q // 2}" if q % 2 == 0 else f"communication {q // 2}->{q // 2 + 1}"}
    r = 6  # as Estimate.to_dict writes them: a saved and reloaded plan compares equal
    return Estimate(latency_ms=round(lat.total, r), warmup_ms=round(lat.warmup, r), steady_ms=round(lat.steady, r),
                    ending_ms=round(lat.ending, r), pivot_stage=q // 2, details=details)
