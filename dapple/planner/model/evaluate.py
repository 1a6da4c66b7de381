"""``evaluate``: the latency model (paper formula 2, or the refined model) of ANY given stages, as an Estimate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

from ...core.checks import flag, positive_int
from ...core.plan import FULL_PRECISION, RECOMPUTE, Estimate, Plan, Recompute, Stage, check_fit, check_stages
from ...core.schedule import (
    CHUNKED_SCHEDULES,
    SCHEDULES,
    SPLIT_BACKWARD,
    WARMUP_POLICIES,
    stage_holds,
    validate_warmup,
    warmup_counts,
)
from ..checks import profile_and_cluster
from ..cuts import check_cuts
from ..simulator.latency import simulated_latency
from .chunks import chunked_unfit, stage_memory
from .cost import CostModel, ServerLayout, Span, layout_of
from .memory import (
    RECOMPUTE_MODES,
    NoFitError,
    StageBytes,
    activation_scale,
    check_stage_memory,
    recompute_mode,
    split_backward_unfit,
)
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
    recompute: list | None = None  # per compute stage: it recomputes its forward in backward (B includes it)

    def latency(self, model: str = "paper", overlap: bool = False) -> Latency:
        """L of formula 2 (``model="paper"``) or of the refined model, with or without overlapped AllReduce."""
        if model == "paper":
            return paper_latency(self.F, self.B, self.AR, self.M)
        return refined_latency(self.F, self.B, self.AR, self.E if overlap else None, self.K, self.M,
                               link_period=self.link_period, chain=self.chain, window=self.window,
                               drain_period=self.drain_period, queue=self.queue, feed=self.feed)


class PricedStages(NamedTuple):
    """What :func:`pipeline_costs` returns."""

    costs: PipelineCosts
    fits: list[int]  # D per stage: micro-batch slices whose activations fit in device memory (paper V-C)


class _Given(NamedTuple):
    """evaluate()'s settings as given (None: not given)."""

    global_batch_size: int | None
    micro_batch_size: int | None
    schedule: str | None
    warmup_policy: str | None
    model: str | None
    overlap: bool | None
    mixed_precision: str | None


class _Options(NamedTuple):
    """evaluate()'s settings once a Plan's own and the defaults have filled the gaps (:func:`_options`)."""

    global_batch_size: int
    micro_batch_size: int
    schedule: str
    warmup_policy: str
    model: str
    overlap: bool
    mixed_precision: str | None


def stage_list(stages: Sequence | Plan, num_layers: int, cluster: "Cluster", micro_batch_size: int) -> list[Stage]:
    """``stages`` as Stage objects: (layer_start, layer_end_exclusive, [devices]) tuples or Stages; validated."""
    if isinstance(stages, Plan):
        stages = stages.stages
    if not isinstance(stages, (list, tuple)) or not stages:
        raise ValueError(f"stages: expected a non-empty list of (layer_start, layer_end, [device ids]) or Stage, "
                         f"got {stages!r:.120}")
    out = []
    for i, s in enumerate(stages):
        if isinstance(s, Stage):
            out.append(Stage(s.layers, s.devices, s.warmup, s.recompute))
        elif isinstance(s, (list, tuple)) and len(s) in (3, 4):
            out.append(Stage((s[0], s[1]), list(s[2]), s[3] if len(s) == 4 else None))
        else:
            raise ValueError(f"stages[{i}]: expected (layer_start, layer_end, [device ids]) or a Stage, got {s!r:.120}")
    check_stages(out, micro_batch_size, "evaluate")
    check_fit(out, num_layers, cluster.num_devices, "evaluate")
    return out


def pipeline_costs(cm: CostModel, spans: Sequence[tuple[int, int, ServerLayout]], M: int, policy: str = "A",
                   warmup: Sequence[int] | None = None, *, check: bool = True, endings: bool = True,
                   recompute: Sequence[Recompute] | None = None) -> PricedStages:
    """Interleaved costs of stages ``spans`` and D per stage (paper V-C).

    Args:
        cm: the cost model of the plan's profile, cluster and micro-batch size.
        spans: (layer start, layer end, server layout) per stage.
        M: micro-batches per iteration.
        policy: warmup policy "A" or "B" for K_i when ``warmup`` is None.
        warmup: K_i per stage, or None.
        check: raise NoFitError, naming the stage, when a stage does not fit in device memory.
        endings: price E, the overlapped AllReduce's ending of each stage (False: E = B, for a caller that
            prices no overlap).
        recompute: per stage, how it recomputes (``core.plan.RECOMPUTE``); None: as ``cm.recompute`` says.
    """
    F, B, AR, E, D, chain, window, queue, RC = [], [], [], [], [], [], [], [], []
    hot: tuple = ()  # the busiest inbound links of stage i (transfers.queues), from the transfer into it
    users: dict = {}  # per server, the communication stages on its uplink and downlink (transfers.feeds)
    mem = cm.cluster.device_memory
    for i, (a, c, lay) in enumerate(spans):
        rc = cm.recompute if recompute is None else recompute[i]
        f, b = cm.compute(a, c, len(lay), rc)
        need = cm.stage_bytes(a, c, len(lay), rc)
        d = need.slices(mem)
        if d < 1 and check:
            _check_memory(i, need, mem, rc, 1)
        D.append(d)
        RC.append(rc)
        F.append(f)
        B.append(b)
        chain.append(b)
        window.append(b)
        AR.append(cm.allreduce(a, c, lay))
        E.append(cm.overlapped_ending(a, c, lay, recompute=rc) if endings else b)
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
    if warmup is None:  # the policy's K_i within D
        K = warmup_counts(len(spans), M, policy, max_in_flight=[max(1, d) for d in D])
    else:
        K = [int(k) for k in warmup]
        if check:
            _check_warmup(cm, spans, K, D, RC)
    period, drain = cm.link_periods(spans)
    queue.append(False)  # the last stage: no gradients from below
    return PricedStages(PipelineCosts(F, B, AR, E, K, M, period, chain, window, drain, queue, feeds(users, len(F)),
                                      RC), D)


def _check_memory(i: int, need: StageBytes, mem: float, recompute: Recompute, warmup: int) -> None:
    """check_stage_memory of stage ``i`` holding ``need`` with K_i = ``warmup``."""
    check_stage_memory(i, need.static, need.per_slice, mem, warmup, need.once if recompute else None)


def _check_warmup(cm: CostModel, spans: Sequence[tuple[int, int, ServerLayout]], K: list[int], D: list[int],
                  recompute: list[Recompute]) -> None:
    """NoFitError naming the first stage whose given K_i is more than its D slices fit (recomputing as
    ``recompute`` says)."""
    for i, (a, c, lay) in enumerate(spans):
        if K[i] > D[i]:
            _check_memory(i, cm.stage_bytes(a, c, len(lay), recompute[i]), cm.cluster.device_memory, recompute[i],
                          K[i])


def evaluate(profile: "Profile", cluster: "Cluster", stages: Sequence | Plan, global_batch_size: int | None = None,
             micro_batch_size: int | None = None, *, schedule: str | None = None, warmup_policy: str | None = None,
             optimizer_factor: float = 4.0, model: str | None = None, overlap: bool | None = None,
             recompute: bool | str | None = None, mixed_precision: str | None = None,
             shard_optimizer: bool | None = None) -> Estimate:
    """Latency of one iteration of ``stages``, with per-stage costs in ``details``.

    ``evaluate(profile, cluster, plan)`` reproduces ``plan.estimate``: for a Plan the defaults are its own batch
    sizes, schedule, policy, and the latency model and overlap it was planned with (``plan.meta``). Otherwise the
    defaults are :func:`dapple.plan`'s (the refined model, AllReduce overlapped), so the same stages get the same
    time from either call; ``model="paper", overlap=False`` is the paper's formula 2.

    Args:
        profile, cluster: the model's profile and the cluster it runs on.
        stages: (layer_start, layer_end_exclusive, [device ids]) tuples, Stages (their warmup K_i is used if
            every stage gives one), or a Plan.
        global_batch_size, micro_batch_size: samples per iteration and per micro-batch.
        schedule: "dapple" (default), "gpipe" or "zb-h1" (the refined model simulates its split backward,
            :mod:`dapple.planner.simulator.latency`; the paper's formula 2 knows only 1F1B); for stages that are
            several chunks per device group, "interleaved-1f1b" or "zb-v" (simulated; their K_i the order's, each
            device's memory every chunk's, :mod:`dapple.planner.model.chunks`).
        warmup_policy: "A" (default) or "B", for K_i when the stages give none.
        optimizer_factor: static bytes per parameter byte.
        model: "refined" (default: :mod:`dapple.planner.model.refined`, as :func:`dapple.plan`) or "paper"
            (formula 2 with the pivot of Algorithm 1).
        overlap: AllReduce overlapped with the last backward, bucket by bucket (default True, as
            :func:`dapple.plan` and the runtime).
        recompute: None: as the stages say (``Stage.recompute``; tuples: no); False, True, "layers" or
            "selective": every stage (``core.plan.RECOMPUTE``); "auto": as :func:`auto_recompute` says (K_i from the
            policy then, or M each for gpipe).
        mixed_precision: "bf16" or "fp16" (activations in half the bytes), "fp32" (full precision), or None: a
            Plan's own ``mixed_precision`` (otherwise full precision).
        shard_optimizer: each stage's optimizer state is sharded over its replicas (ZeRO-1, as
            :func:`dapple.shard_optimizer` runs it): a stage on r replicas holds the weights and gradients whole and
            1/r of the rest of ``optimizer_factor``; None: a Plan's own ``shard_optimizer`` (otherwise False).
            ``details["stages"][i]["memory_gb"]`` shows it.

    Raises:
        ValueError: bad input; NoFitError (a ValueError): a plan that does not fit in device memory (naming the
            stage).
    """
    profile_and_cluster("evaluate", profile, cluster)
    if shard_optimizer is None:
        shard_optimizer = stages.shard_optimizer if isinstance(stages, Plan) else False
    flag("shard_optimizer", shard_optimizer, "shard each stage's optimizer state over its replicas")
    opt = _options(profile, stages, _Given(global_batch_size, micro_batch_size, schedule, warmup_policy, model,
                                             overlap, mixed_precision))
    b = opt.micro_batch_size
    sts = stage_list(stages, profile.num_layers, cluster, b)
    check_cuts(profile, sts, "evaluate")
    M = opt.global_batch_size // b
    if opt.schedule in CHUNKED_SCHEDULES:
        recompute_mode(recompute, (None, *RECOMPUTE))
        cm = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor,
                       recompute=False if recompute is None else recompute, mixed_precision=opt.mixed_precision,
                       shard_optimizer=shard_optimizer)
        chunk_flags = [s.recompute for s in sts] if recompute is None else [recompute] * len(sts)
        return _chunked(profile, cluster, cm, sts, opt, chunk_flags)
    given = _given_warmup(sts, M, opt.schedule)
    recompute_mode(recompute, (None,) + RECOMPUTE_MODES)
    auto = recompute == "auto"
    cm = CostModel(profile, cluster, b, optimizer_factor=optimizer_factor,
                   recompute=False if recompute is None or auto else recompute, mixed_precision=opt.mixed_precision,
                   shard_optimizer=shard_optimizer)
    spans = [Span(s.layers[0], s.layers[1], layout_of(cluster, s.devices)) for s in sts]
    flags: list[Recompute] | None
    if auto:
        given = [M] * len(sts) if opt.schedule == "gpipe" else None
        flags = [r for r in auto_recompute(cm, spans, M, opt.warmup_policy, given, opt.model, opt.overlap)]
    else:
        flags = [s.recompute for s in sts] if recompute is None else None
    pc, D = pipeline_costs(cm, spans, M, opt.warmup_policy, given, recompute=flags)
    lat = pc.latency(opt.model, opt.overlap)
    lat = lat._replace(ending=lat.ending + profile.step_ms)  # the step's own fixed cost (Profile.step_ms)
    if opt.schedule in SPLIT_BACKWARD:
        rc = flags if flags is not None else [recompute if recompute is not None else False] * len(sts)
        played = Plan(opt.global_batch_size, b, [Stage(s.layers, s.devices, k, r) for s, k, r in zip(sts, pc.K, rc)],
                      schedule=opt.schedule, mixed_precision=opt.mixed_precision, shard_optimizer=shard_optimizer)
        if why := split_backward_unfit(cm, played.stages, M, cluster.device_memory):
            raise NoFitError(f"schedule={opt.schedule!r}: the plan does not fit: {why}")
        if opt.model == "refined":  # the closed form is 1F1B's: simulate the split
            lat = simulated_latency(played, profile, cluster, opt.overlap)
    return make_estimate(cm, spans, pc, D, lat, model=opt.model, overlap=opt.overlap, schedule=opt.schedule)


def _chunked(profile: "Profile", cluster: "Cluster", cm: CostModel, stages: list[Stage], opt: _Options,
             recompute: list[Recompute]) -> Estimate:
    """evaluate() of stages that are chunks (a schedule of :data:`CHUNKED_SCHEDULES`): the simulated iteration (no
    closed form prices them), each chunk's costs, each device's memory (every chunk's activations in flight)."""
    if opt.model != "refined":
        raise ValueError(f"model={opt.model!r}: formula 2 prices one stage per device; a plan of chunks "
                         f"({opt.schedule}) is priced by simulating it (model='refined')")
    played = Plan(opt.global_batch_size, opt.micro_batch_size,
                  [Stage(s.layers, s.devices, None, r) for s, r in zip(stages, recompute)], schedule=opt.schedule,
                  mixed_precision=opt.mixed_precision, shard_optimizer=cm.shard_optimizer)  # K_i: the order's
    M = played.num_micro_batches
    if why := chunked_unfit(cm, played.stages, M, opt.schedule, cluster.device_memory):
        raise NoFitError(f"schedule={opt.schedule!r}: the plan does not fit: {why}")
    spans = [Span(s.layers[0], s.layers[1], layout_of(cluster, s.devices)) for s in stages]
    pc, D = pipeline_costs(cm, spans, M, opt.warmup_policy, played.warmup, check=False, recompute=recompute)
    lat = simulated_latency(played, profile, cluster, opt.overlap)
    return make_estimate(cm, spans, pc, D, lat, model=opt.model, overlap=opt.overlap, schedule=opt.schedule,
                         memory=stage_memory(cm, played.stages, M, opt.schedule), devices=played.num_devices)


def auto_recompute(cm: CostModel, spans: Sequence[Span], M: int, policy: str = "A",
                   warmup: Sequence[int] | None = None, model: str = "refined", overlap: bool = False) -> list[bool]:
    """Which stages recompute under recompute="auto": only where memory binds, and then only if that is faster.

    With K_i = 1 a recomputing stage holds its inputs on top of what a plain one holds (memory.StageBytes), so
    recomputation never makes a stage fit that does not fit at all: it lets a stage hold more micro-batches.
    Two choices are priced: "need", the stages that cannot hold their given ``warmup`` K_i otherwise (none without
    ``warmup``), and "hold", also every stage whose policy's K_i (capped by what fits either way) is above what fits
    without recomputing, its K_i that would have to drop. The faster under ``model`` wins; "need" on ties.

    Args:
        cm: the cost model (its own ``recompute`` is not used).
        spans: (layer start, layer end, server layout) per stage.
        M, policy, warmup: micro-batches, warmup policy, and K_i per stage if fixed (gpipe: M each).
        model, overlap: the latency model, and whether the AllReduce overlaps the last backward.
    """
    mem = cm.cluster.device_memory
    plain = [cm.stage_bytes(a, c, len(lay), False).slices(mem) for a, c, lay in spans]
    again = [cm.stage_bytes(a, c, len(lay), True).slices(mem) for a, c, lay in spans]
    if warmup is not None:
        need = [p < k <= r for p, k, r in zip(plain, warmup, again)]
    else:
        need = [False] * len(spans)
    caps = [max(1, r if r > p else p) for p, r in zip(plain, again)]
    K = list(warmup) if warmup is not None else warmup_counts(len(spans), M, policy, max_in_flight=caps)
    hold = [n or p < k <= r for n, p, k, r in zip(need, plain, K, again)]
    if hold == need:
        return need
    lat = [pipeline_costs(cm, spans, M, policy, warmup, check=False, recompute=flags)[0].latency(model, overlap).total
           for flags in (need, hold)]
    return hold if lat[1] < lat[0] else need


def _options(profile: "Profile", stages: object, given: _Given) -> _Options:
    """evaluate()'s settings (``given``: as passed, None where not): a Plan's own where not given, then the
    defaults; ValueError naming a bad one."""
    g, b, schedule, policy, model, overlap, mixed_precision = given
    if isinstance(stages, Plan):
        mixed_precision = stages.precision(mixed_precision)
    elif mixed_precision is not None:
        mixed_precision = None if mixed_precision == FULL_PRECISION else mixed_precision
        activation_scale(mixed_precision)  # (checks it)
    if isinstance(stages, Plan):
        stages.check_layers(profile.layer_names, f"the profile of {profile.model}")
        g = g or stages.global_batch_size
        b = b or stages.micro_batch_size
        schedule = schedule or stages.schedule
        policy = policy or stages.warmup_policy
        model = model or stages.meta.get("latency_model")
        overlap = stages.meta.get("overlap") if overlap is None else overlap
    # plan()'s defaults: the refined model with the AllReduce overlapped, as the runtime runs every plan
    schedule, policy, model = schedule or "dapple", policy or "A", model or "refined"
    overlap = True if overlap is None else overlap
    g = positive_int("global_batch_size", g)
    b = positive_int("micro_batch_size", b)
    if g % b:
        raise ValueError(f"global_batch_size {g} is not divisible by micro_batch_size {b}")
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if policy not in WARMUP_POLICIES:
        raise ValueError(f"warmup_policy: expected one of {WARMUP_POLICIES}, got {policy!r}")
    return _Options(g, b, schedule, policy, model, bool(overlap), mixed_precision)


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
                  model: str, overlap: bool, schedule: str, memory: Sequence[float] | None = None,
                  devices: int | None = None) -> Estimate:
    """An Estimate with ``details``: per-stage F/B/AR/comm/K_i/D/memory, bubble fraction, ACR, pivot. Stages that
    are chunks give ``memory`` (per stage: its devices' peak bytes, all their chunks) and ``devices`` (distinct)."""
    # a split backward holds each micro-batch until its W: stage i holds stage_holds' count, not K_i
    held = stage_holds(pc.K, pc.M) if schedule in SPLIT_BACKWARD and memory is None else list(pc.K)
    per = [_stage_details(cm, pc, i, span, D[i], overlap=overlap, held=held[i],
                          memory=None if memory is None else memory[i]) for i, span in enumerate(spans)]
    busy = 0.0
    for i, (_, _, lay) in enumerate(spans):
        busy += len(lay) * pc.M * (pc.F[2 * i] + pc.B[2 * i])
    if devices is None:
        devices = sum(len(lay) for _, _, lay in spans)
    comm = [pc.F[j] + pc.B[j] for j in range(1, len(pc.F), 2)]
    compute = [pc.F[j] + pc.B[j] for j in range(0, len(pc.F), 2)]
    acr = (sum(comm) / len(comm)) / (sum(compute) / len(compute)) if comm and sum(compute) > 0 else 0.0
    q = lat.pivot
    details = {"model": model, "schedule": schedule, "overlap": overlap, "num_micro_batches": pc.M,
               **({"mixed_precision": cm.mixed_precision} if cm.mixed_precision else {}),
               **({"shard_optimizer": True} if cm.shard_optimizer else {}),
               "stages": per, "bubble_fraction": round(max(0.0, 1 - busy / (devices * lat.total)), 6)
               if lat.total > 0 else 0.0, "acr": round(acr, 6),
               "pivot": f"stage {q // 2}" if q % 2 == 0 else f"communication {q // 2}->{q // 2 + 1}"}
    r = 6  # as Estimate.to_dict writes them: a saved and reloaded plan compares equal
    return Estimate(latency_ms=round(lat.total, r), warmup_ms=round(lat.warmup, r), steady_ms=round(lat.steady, r),
                    ending_ms=round(lat.ending, r), pivot_stage=q // 2, details=details)


def _stage_details(cm: CostModel, pc: PipelineCosts, i: int, span: Span, d: int, *, overlap: bool,
                   held: int, memory: float | None = None) -> dict:
    """``details["stages"][i]``: stage i's costs, rounded as Estimate.to_dict writes them (``memory_gb`` with
    ``held`` micro-batches' activations: K_i, or more under a split backward; ``memory``: bytes given, a chunk's
    device's)."""
    a, c, lay = span
    k = pc.K[i]
    rc = pc.recompute[i] if pc.recompute else False
    out = {"layers": [a, c], "replicas": len(lay), "rows": cm.rows(len(lay)),
           "forward_ms": round(pc.F[2 * i], 6), "backward_ms": round(pc.B[2 * i], 6),
           "allreduce_ms": round(pc.AR[2 * i], 6), "warmup": k, "max_in_flight": int(min(d, 1 << 20)),
           "memory_gb": round((cm.stage_bytes(a, c, len(lay), rc).peak(k if rc else held) if memory is None
                               else memory) / 1e9, 4)}
    if rc:
        out["recompute"] = rc
    if overlap and len(lay) > 1:
        out["overlapped_ending_ms"] = round(pc.E[2 * i], 6)
    if 2 * i + 1 < len(pc.F):  # it sends to a next stage
        out["send_forward_ms"] = round(pc.F[2 * i + 1], 6)
        out["send_backward_ms"] = round(pc.B[2 * i + 1], 6)
    return out
