"""Plans of two chunks per device group for ``dapple.plan``: the search's device groups (and one device per group),
the layers cut again into chunks in the loop or V order, judged by the simulator (docs/planner.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..core.chunk_schedule import PLACEMENT_OF
from ..core.chunks import group_order
from ..core.plan import Plan, Recompute, Stage
from ..core.schedule import CHUNKED_SCHEDULES
from . import tuning
from .judge import faster
from .model.chunks import chunked_unfit
from .model.cost import CostModel, layout_of
from .model.evaluate import evaluate
from .model.memory import NoFitError
from .simulator.events import Deadlock, simulate

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.profile import Profile

CHUNKS = 2  # chunks per device group that dapple.plan considers (v)
LAYOUTS = ("the plan's device groups", "one device per group")


def balanced_cuts(cost: Sequence[Sequence[float]], pieces: Sequence[int],
                  send: Callable[[int, int], float] | None = None) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per piece, that minimise the slowest piece: piece k costs the sum of
    ``cost[pieces[k]][layer]`` over its layers (each device group times the layers on its own rows), plus
    ``send(k, end)``: its transfers to the next piece when it ends before layer ``end`` (none by default).

    Exact: a DP over (piece, end), the starts of each piece vectorised.
    """
    n, K = len(cost[0]), len(pieces)
    if n < K:
        raise ValueError(f"{n} layers cannot make {K} chunks")
    sums = [np.concatenate(([0.0], np.cumsum(np.asarray(c, dtype=float)))) for c in cost]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0  # the slowest piece so far, the pieces before ending at each layer
    starts = []  # per piece: the best start for each end
    for k, g in enumerate(pieces):
        new, arg = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=int)
        ends = [n] if k == K - 1 else range(k + 1, n - (K - k - 1) + 1)
        for j in ends:
            extra = send(k, j) if send is not None and k < K - 1 else 0.0
            vals = np.maximum(best[k:j], sums[g][j] - sums[g][k:j] + extra)
            t = int(np.argmin(vals))
            new[j], arg[j] = vals[t], k + t
        best = new
        starts.append(arg)
    out, end = [], n
    for k in reversed(range(K)):
        start = int(starts[k][end])
        out.append((start, end))
        end = start
    return out[::-1]


def variant(profile: "Profile", cluster: "Cluster", p: Plan, groups: Sequence[Sequence[int]], schedule: str,
            recompute: Recompute = False, optimizer_factor: float = 4.0) -> Plan:
    """``p``'s micro-batching on device ``groups`` (each its devices, replica order), two chunks per group in
    ``schedule``'s order, the layers cut by :func:`balanced_cuts` (without estimate or meta)."""
    order = group_order(len(groups), CHUNKS, PLACEMENT_OF[schedule])
    cm = CostModel(profile, cluster, p.micro_batch_size, optimizer_factor=optimizer_factor, recompute=recompute,
                   mixed_precision=p.mixed_precision, shard_optimizer=p.shard_optimizer)
    cost = [[sum(cm.compute(k, k + 1, len(ds))) for k in range(profile.num_layers)] for ds in groups]
    places = [layout_of(cluster, ds) for ds in groups]

    def send(k: int, end: int) -> float:  # activations out of chunk k and gradients back (none within a group)
        g, h = order[k], order[k + 1]
        return 0.0 if g == h else sum(cm.comm(end - 1, places[g], places[h]))

    spans = balanced_cuts(cost, order, send)
    return Plan(p.global_batch_size, p.micro_batch_size,
                [Stage(span, list(groups[g]), None, recompute) for span, g in zip(spans, order)], schedule=schedule,
                warmup_policy=p.warmup_policy, layer_names=p.layer_names, mixed_precision=p.mixed_precision,
                shard_optimizer=p.shard_optimizer)


def layouts(p: Plan) -> dict[str, list[list[int]]]:
    """The device groups the variants take: ``p``'s (its stages' devices), and one device per group (when other)."""
    own = [list(s.devices) for s in p.stages]
    single = [[d] for d in range(p.num_devices)]
    return {LAYOUTS[0]: own, **({LAYOUTS[1]: single} if single != own else {})}


def chunked_trials(profile: "Profile", cluster: "Cluster", p: Plan, schedules: Sequence[str], *, overlap: bool,
                   optimizer_factor: float, recompute: Recompute = False) -> tuple[list[dict], dict[int, Plan]]:
    """Every variant of ``p`` (:func:`layouts` x ``schedules`` of :data:`CHUNKED_SCHEDULES`): what each came to
    (``layout``, ``groups``, ``schedule``, and ``simulated_ms`` or ``refused``: why it was not simulated), and the
    Plans simulated, by their index in that list."""
    records, plans = [], {}
    M = p.num_micro_batches
    for label, groups in layouts(p).items():
        for schedule in schedules:
            rec: dict = {"layout": label, "groups": len(groups), "schedule": schedule}
            records.append(rec)
            if why := _refused(profile.num_layers, len(groups), p.num_devices * M):
                rec["refused"] = why
                continue
            q = variant(profile, cluster, p, groups, schedule, recompute, optimizer_factor)
            cm = CostModel(profile, cluster, p.micro_batch_size, optimizer_factor=optimizer_factor,
                           mixed_precision=p.mixed_precision, shard_optimizer=p.shard_optimizer)
            if why := chunked_unfit(cm, q.stages, M, schedule, cluster.device_memory):
                rec["refused"] = why
                continue
            try:
                rec["simulated_ms"] = round(simulate(q, profile, cluster, overlap=overlap).latency_ms, 6)
            except Deadlock as e:  # an order that cannot run (its runtime would wait forever too)
                rec["refused"] = str(e)
                continue
            plans[len(records) - 1] = q
    return records, plans


def moved_cuts(q: Plan, ms: float, judge: Callable[[Plan], float | None],
               budget: int | None = None) -> tuple[Plan, float, int]:
    """``q`` (simulated at ``ms``) with its chunk cuts moved one layer at a time while the simulator (``judge``: ms,
    or None for a plan that does not fit or run) says faster, at most ``budget`` (SearchTuning.chunk_moves)
    simulations: the balanced cuts weigh compute and transfers, not a replicated chunk's AllReduce or the
    schedule's order. Returns (the plan, its ms, the moves taken)."""
    budget = tuning.TUNING.chunk_moves if budget is None else budget
    tried, moves, better = 0, 0, True
    while better and tried < budget:
        better = False
        for k in range(len(q.stages) - 1):  # the cut between chunk k and k + 1 (pipeline order)
            for step in (-1, 1):
                cand = _shifted(q, k, step)
                if cand is None or tried >= budget:
                    continue
                tried += 1
                got = judge(cand)
                if got is not None and got < ms * (1 - tuning.TUNING.tie):
                    q, ms, moves, better = cand, got, moves + 1, True
    return q, ms, moves


def _shifted(q: Plan, k: int, step: int) -> Plan | None:
    """``q`` with the cut after chunk ``k`` moved ``step`` layers (None where a chunk would be left empty)."""
    (a, c), (_, e) = q.stages[k].layers, q.stages[k + 1].layers
    cut = c + step
    if not a < cut < e:
        return None
    spans = [s.layers for s in q.stages]
    spans[k], spans[k + 1] = (a, cut), (cut, e)
    stages = [Stage(span, list(s.devices), None, s.recompute) for span, s in zip(spans, q.stages)]  # K_i anew
    return Plan(q.global_batch_size, q.micro_batch_size, stages, schedule=q.schedule, warmup_policy=q.warmup_policy,
                layer_names=q.layer_names, mixed_precision=q.mixed_precision, shard_optimizer=q.shard_optimizer)


def _simulated(q: Plan, profile: "Profile", cluster: "Cluster", cm: CostModel, overlap: bool) -> float | None:
    """``q``'s simulated ms, or None where it does not fit in memory or cannot run."""
    if chunked_unfit(cm, q.stages, q.num_micro_batches, q.schedule, cluster.device_memory):
        return None
    try:
        return simulate(q, profile, cluster, overlap=overlap).latency_ms
    except Deadlock:
        return None


def _move_the_closest(trials: list[dict], plans: dict[int, Plan], base: float | None, args: dict,
                      overlap: bool) -> None:
    """The fastest variant, where within SearchTuning.verify_within of ``base`` (the plan of one stage per group;
    None: any), with its cuts moved (:func:`moved_cuts`); its record gains ``moves``."""
    if not plans:
        return
    k = min(plans, key=lambda i: trials[i]["simulated_ms"])
    ms = trials[k]["simulated_ms"]
    if base is not None and ms > base * (1 + tuning.TUNING.verify_within):
        return
    profile, cluster, q = args["profile"], args["cluster"], plans[k]
    cm = CostModel(profile, cluster, q.micro_batch_size, optimizer_factor=args["optimizer_factor"],
                   mixed_precision=q.mixed_precision, shard_optimizer=q.shard_optimizer)
    plans[k], ms, trials[k]["moves"] = moved_cuts(q, ms, lambda x: _simulated(x, profile, cluster, cm, overlap))
    trials[k]["simulated_ms"] = round(ms, 6)


def _refused(num_layers: int, groups: int, work: int) -> str:
    """Why a layout of ``groups`` device groups is not tried ("" where it is); ``work``: devices x micro-batches."""
    if groups < 2:
        return "one device group: no pipeline to interleave"
    if num_layers < CHUNKS * groups:
        return f"{num_layers} layers cannot make {CHUNKS * groups} chunks"
    if work > tuning.TUNING.simulate_limit:
        return (f"{work} devices x micro-batches: above SearchTuning.simulate_limit "
                f"({tuning.TUNING.simulate_limit}), not simulated")
    return ""


def chunked_schedules(schedule: str) -> tuple[str, ...]:
    """The schedules of chunks ``dapple.plan(schedule=...)`` tries: both for "auto", the one named, else none."""
    return CHUNKED_SCHEDULES if schedule == "auto" else (schedule,) if schedule in CHUNKED_SCHEDULES else ()


def settle_chunks(p: Plan, args: dict, schedules: tuple[str, ...], named: bool) -> Plan:
    """plan()'s last word on chunks: ``p`` (one stage per device group; ``args``: plan()'s arguments), or its fastest
    two-chunk variant under ``schedules`` (:func:`chunked_trials`) where one simulates faster (by SearchTuning.tie;
    ``named``: the fastest that fits, whatever ``p`` takes). The record joins ``meta["schedule_choice"]``: each
    variant's layout, schedule and simulated ms (or why not simulated). A plan of chunks claims no lower bound: the
    search's is one of one stage per device group."""
    profile, cluster, overlap = args["profile"], args["cluster"], bool(p.meta.get("overlap"))
    if not schedules:
        raise ValueError(f"schedule={args['schedule']!r}: a plan of chunks is priced by simulating it; use "
                         f"model='refined' (got model={args['model']!r})")
    rc = False if args["recompute"] == "auto" else args["recompute"]  # ("auto": the chunks do not recompute)
    trials, plans = chunked_trials(profile, cluster, p, schedules, overlap=overlap,
                                   optimizer_factor=args["optimizer_factor"], recompute=rc)
    record = dict(p.meta.get("schedule_choice") or {})
    record["chunked"] = trials
    base = None if named else record.get("simulated_ms", {}).get(p.schedule)
    if base is None and not named:
        base = simulate(p, profile, cluster, overlap=overlap).latency_ms
    _move_the_closest(trials, plans, base, args, overlap)
    best = None
    for k in sorted(plans):
        if faster(trials[k]["simulated_ms"], base):
            best, base = k, trials[k]["simulated_ms"]
    if best is None:
        if named:
            raise NoFitError(f"schedule={args['schedule']!r}: no plan of two chunks per device group fits or can be "
                             f"cut: {'; '.join(t['layout'] + ': ' + t['refused'] for t in trials)}")
        p.meta["schedule_choice"] = {**record, "chosen": p.schedule}
        return p
    q = plans[best]
    est = evaluate(profile, cluster, q, optimizer_factor=args["optimizer_factor"], model="refined", overlap=overlap)
    meta = {**p.meta, "schedule_choice": {**record, "chosen": q.schedule, "chosen_layout": trials[best]["layout"]},
            "search_schedule": "dapple"}
    meta.pop("latency_lower_bound_ms", None)
    meta.pop("placement", None)  # (the search's placement of its own stages)
    if "simulated_ms" in meta:
        meta["simulated_ms"] = round(trials[best]["simulated_ms"], 4)
    return Plan(q.global_batch_size, q.micro_batch_size, q.stages, schedule=q.schedule,
                warmup_policy=q.warmup_policy, layer_names=p.layer_names, estimate=est, meta=meta,
                mixed_precision=q.mixed_precision, shard_optimizer=q.shard_optimizer)
