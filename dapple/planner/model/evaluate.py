"""``evaluate``: the latency model (paper formula 2, or the refined model) of ANY given stages, as an Estimate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

from ...core.checks import positive_int
from ...core.plan import Estimate, Plan, Stage, check_fit, check_stages
from ...core.schedule import SCHEDULES, SPLIT_BACKWARD, WARMUP_POLICIES, validate_warmup, warmup_counts
from ..checks import profile_and_cluster
from ..simulator.latency import simulated_latency
from .cost import CostModel, Span, layout_of
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
    window: list | None = None  # the same in the steady state (CommLinks.window)
    drain_period: float | None = None  # the same once activations stop: gradients alone (default link_period)
    queue: list | None = None  # per compute stage: its first gradient queues behind its activations (queues)
    feed: list | None = None  # per stage: the warmup's floor where server links carry several stages (feeds)

    def latency(self, model: str = "paper", overlap: bool = False) -> Latency:
        """L of formula 2 (``model="paper"``) or of the refined model, with or without overlapped AllReduce."""
        if model == "paper":
            return paper_latency(self.F, self.B, self.AR, self.M)
        return refined_latency(self.F, self.B, self.AR, self.E if overlap else None, self.K, self.M,
                               self.link_period, self.chain, self.window, self.drain_period, self.queue,
                               self.feed)


class PricedStages(NamedTuple):
    """What :func:`pipeline_costs` returns."""

    costs: PipelineCosts
    fits: list[int]  # D per stage: micro-batch slices whose activations fit in device memory (paper V-C)


class _Options(NamedTuple):
    """evaluate()'s settings once a Plan's own have filled the gaps."""

    global_batch_size: int
    micro_batch_size: int
    schedule: str
    warmup_policy: str
    model: str
    overlap: bool


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


def pipeline_costs(cm: CostModel, spans: Sequence[Span], M: int, policy: str = "A",
                   warmup: Sequence[int] | None = None, check: bool = True, endings: bool = True) -> PricedStages:
    """Interleaved costs of stages ``spans`` and D per stage (paper V-C).

    Args:
        cm: the cost model of the plan's profile, cluster and micro-batch size.
        spans: (layer start, layer end, server layout) per stage.
        M: micro-batches per iteration.
        policy: warmup policy "A" or "B" for K_i when ``warmup`` is None.
        warmup: K_i per stage, or None.
        check: raise ValueError, naming the stage, when a stage does not fit in device memory.
        endings: price E, the overlapped AllReduce's ending of each stage (False: E = B, for a caller that
            prices no overlap).
    """
    F, B, AR, E, D, chain, window, queue = [], [], [], [], [], [], [], []
    hot: tuple = ()  # the busiest inbound links of stage i (transfers.queues), from the transfer into it
    users: dict = {}  # per server, the communication stages on its uplink and downlink (transfers.feeds)
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
        if i + 1 < len(spans):  # the communication stage to the next
            pair = cm.comm_pair(lay, spans[i + 1][2])
            queue.append(queues(hot, pair.ports))
            cl = pair(c - 1)
            F.append(cl.busiest)
            B.append(cl.busiest)
            chain.append(cl.chain)
            window.append(cl.window)
            hot = cl.hot
            users = add_users(users, cl.servers, 2 * i + 1)
            AR.append(0.0)
            E.append(cl.busiest)
    K = _warmup(cm, spans, M, policy, warmup, D, check)
    period, drain = cm.link_periods(spans)
    queue.append(False)  # the last stage: no gradients from below
    return PricedStages(PipelineCosts(F, B, AR, E, K, M, period, chain, window, drain, queue, feeds(users, len(F))), D)


def _warmup(cm: CostModel, spans: Sequence[Span], M: int, policy: str, warmup: Sequence[int] | None,
            D: list[int], check: bool) -> list[int]:
    """K_i: the policy's within D, or ``warmup`` (checked against device memory with ``check``)."""
    if warmup is None:
        return warmup_counts(len(spans), M, policy, max_in_flight=[max(1, d) for d in D])
    K = [int(k) for k in warmup]
    if check:
        for i, (a, c, lay) in enumerate(spans):
            if K[i] > D[i]:
                check_stage_memory(i, cm.static_bytes(a, c), cm.saved_bytes(a, c, len(lay)), cm.cluster.device_memory,
                                   K[i])
    return K


def evaluate(profile: "Profile", cluster: "Cluster", stages: Sequence, global_batch_size: int | None = None,
             micro_batch_size: int | None = None, *, schedule: str | None = None, warmup_policy: str | None = None,
             optimizer_factor: float = 4.0, model: str | None = None, overlap: bool | None = None) -> Estimate:
    """Latency of one iteration of ``stages``, with per-stage costs in ``details``.

    ``evaluate(profile, cluster, plan)`` reproduces ``plan.estimate``: for a Plan the defaults are its own batch
    sizes, schedule, policy, and the latency model and overlap it was planned with (``plan.meta``).

    Args:
        profile, cluster: the model's profile and the cluster it runs on.
        stages: (layer_start, layer_end_exclusive, [device ids]) tuples, Stages (their warmup K_i is used if
            every stage gives one), or a Plan.
        global_batch_size, micro_batch_size: samples per iteration and per micro-batch.
        schedule: "dapple" (default), "gpipe" or "zb-h1" (the refined model simulates its split backward,
            :mod:`dapple.planner.simulator.latency`; the paper's formula 2 knows only 1F1B).
        warmup_policy: "A" (default) or "B", for K_i when the stages give none.
        optimizer_factor: static bytes per parameter byte.
        model: "paper" (default: formula 2 with the pivot of Algorithm 1) or "refined"
            (:mod:`dapple.planner.model.refined`).
        overlap: AllReduce overlapped with the last backward (default False).

    Raises:
        ValueError: bad input, or a plan that does not fit in device memory (naming the stage).
    """
    profile_and_cluster("evaluate", profile, cluster)
    opt = _options(profile, stages, global_batch_size, micro_batch_size, schedule, warmup_policy, model, overlap)
    b = opt.micro_batch_size
    sts = stage_list(stages, profile.num_layers, cluster, b)
    M = opt.global_batch_size // b
    given = _given_warmup(sts, M, opt.schedule)
    cm = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor)
    spans = [Span(s.layers[0], s.layers[1], layout_of(cluster, s.devices)) for s in sts]
    pc, D = pipeline_costs(cm, spans, M, opt.warmup_policy, given)
    lat = pc.latency(opt.model, opt.overlap)
    if opt.schedule in SPLIT_BACKWARD and opt.model == "refined":  # the closed form is 1F1B's: simulate the split
        played = Plan(opt.global_batch_size, b, [Stage(s.layers, s.devices, k) for s, k in zip(sts, pc.K)],
                      schedule=opt.schedule)
        lat = simulated_latency(played, profile, cluster, opt.overlap)
    return make_estimate(cm, spans, pc, D, lat, model=opt.model, overlap=opt.overlap, schedule=opt.schedule)


def _options(profile: "Profile", stages: object, g: int | None, b: int | None, schedule: str | None,
             policy: str | None, model: str | None, overlap: bool | None) -> _Options:
    """evaluate()'s settings: a Plan's own where not given, then the defaults; ValueError naming a bad one."""
    if isinstance(stages, Plan):
        stages.check_layers(profile.layer_names, f"the profile of {profile.model}")
        g = g or stages.global_batch_size
        b = b or stages.micro_batch_size
        schedule = schedule or stages.schedule
        policy = policy or stages.warmup_policy
        model = model or stages.meta.get("latency_model")
        overlap = stages.meta.get("overlap") if overlap is None else overlap
    schedule, policy, model = schedule or "dapple", policy or "A", model or "paper"
    positive_int("global_batch_size", g)
    positive_int("micro_batch_size", b)
    if g % b:  # type: ignore[operator]
        raise ValueError(f"global_batch_size {g} is not divisible by micro_batch_size {b}")
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if policy not in WARMUP_POLICIES:
        raise ValueError(f"warmup_policy: expected one of {WARMUP_POLICIES}, got {policy!r}")
    return _Options(g, b, schedule, policy, model, bool(overlap))  # type: ignore[arg-type]


def _given_warmup(stages: list[Stage], M: int, schedule: str) -> list[int] | None:
    """The stages' own K_i (all or none; M each for gpipe, which holds every micro-batch), or None."""
    given = [s.warmup for s in stages]
    if any(k is not None for k in given) and not all(k is not None for k in given):
        raise ValueError(f"stages: give warmup K_i for every stage or for none, got {given}")
    if schedule == "gpipe":
        return [M] * len(stages)
    if given[0] is not None:
        validate_warmup(given, M)
        return given  # type: ignore[return-value]
    return None


def make_estimate(cm: CostModel, spans: Sequence[Span], pc: PipelineCosts, D: Sequence[int], lat: Latency, *,
                  model: str, overlap: bool, schedule: str) -> Estimate:
    """An Estimate with ``details``: per-stage F/B/AR/comm/K_i/D/memory, bubble fraction, ACR, pivot."""
    per = [_stage_details(cm, pc, i, span, D[i], overlap, i + 1 < len(spans)) for i, span in enumerate(spans)]
    busy = 0.0
    for i, (_, _, lay) in enumerate(spans):
        busy += len(lay) * pc.M * (pc.F[2 * i] + pc.B[2 * i])
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


def _stage_details(cm: CostModel, pc: PipelineCosts, i: int, span: Span, d: int, overlap: bool,
                   sends: bool) -> dict:
    """``details["stages"][i]``: stage i's costs, rounded as Estimate.to_dict writes them."""
    a, c, lay = span
    k = pc.K[i]
    out = {"layers": [a, c], "replicas": len(lay), "rows": cm.rows(len(lay)),
           "forward_ms": round(pc.F[2 * i], 6), "backward_ms": round(pc.B[2 * i], 6),
           "allreduce_ms": round(pc.AR[2 * i], 6), "warmup": k, "max_in_flight": int(min(d, 1 << 20)),
           "memory_gb": round((cm.static_bytes(a, c) + k * cm.saved_bytes(a, c, len(lay))) / 1e9, 4)}
    if overlap and len(lay) > 1:
        out["overlapped_ending_ms"] = round(pc.E[2 * i], 6)
    if sends:
        out["send_forward_ms"] = round(pc.F[2 * i + 1], 6)
        out["send_backward_ms"] = round(pc.B[2 * i + 1], 6)
    return out
