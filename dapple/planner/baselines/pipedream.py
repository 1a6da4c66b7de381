"""PipeDream's hierarchical planner (optimizer_graph_hierarchical.py), re-implemented as a baseline Plan."""

from __future__ import annotations

import math
import random
import re
import time
from typing import NamedTuple, Sequence

from ...core.checks import is_int, is_real
from ...core.cluster import Cluster
from ...core.plan import Plan, Stage
from ...core.profile import Profile
from ..checks import instance
from ..profiled import profiled
from .pipedream_dp import SOURCE, analyze_partitioning, compute_partitioning, dp_time
from .pipedream_graph import Graph, State, build_states


def _desc(name: str) -> str:
    """PipeDream's node_desc: our from_pipedream names layers 'nodeN:<desc>'."""
    return re.sub(r"^node\d+:", "", name)


def _inputs(prof: Profile) -> list[list[int]]:
    return [(layer.inputs if layer.inputs is not None else ([i - 1] if i else [])) for i, layer in
            enumerate(prof.layers)]


def layer_activation_sizes(prof: Profile, batch: float) -> list[float]:
    """Each layer's output bytes (PipeDream's activation_size), recovered from boundary_bytes: boundary[i] =
    sum of out[k], k <= i, still read after i; a layer nobody reads falls back to its saved_bytes."""
    c, inputs, n = prof.costs(batch), _inputs(prof), prof.num_layers
    last_use = list(range(n))
    for i, ins in enumerate(inputs):
        for k in ins:
            last_use[k] = max(last_use[k], i)
    dying: list[list[int]] = [[] for _ in range(n)]  # outputs whose last reader is layer i
    for k in range(n):
        if last_use[k] > k:
            dying[last_use[k]].append(k)
    out = [0.0] * n
    for i in range(n):
        if last_use[i] > i:
            prev = c.boundary_bytes[i - 1] if i else 0.0
            out[i] = max(0.0, c.boundary_bytes[i] - prev + sum(out[k] for k in dying[i]))
        else:
            out[i] = c.saved_bytes[i]
    return out


def cluster_levels(cluster: Cluster) -> list[tuple[int, float]]:
    """PipeDream's levels for a Cluster, innermost first (-n 8 2 -b intra inter); levels of 1 are dropped."""
    levels = [(n, float(bw)) for n, bw in ((cluster.devices_per_server, cluster.intra_bandwidth),
                                           (cluster.servers, cluster.inter_bandwidth)) if n > 1]
    return levels or [(1, float(cluster.intra_bandwidth))]


def _check_levels(cluster: Cluster, levels) -> list[tuple[int, float]]:
    try:
        lv = [(m, float(bw)) for m, bw in levels]
    except (TypeError, ValueError):
        lv = []
    if not lv or any(not is_int(m, 1) or not bw > 0 for m, bw in lv):
        raise ValueError(f"pipedream_plan: levels must be (machines >= 1, bandwidth in B/s > 0) pairs, innermost "
                         f"first (PipeDream's -n 8 2 -b 5e10 3.125e9 is [(8, 5e10), (2, 3.125e9)]), got {levels!r}")
    if math.prod(m for m, _ in lv) > cluster.num_devices:
        raise ValueError(f"pipedream_plan: levels {lv} need {math.prod(m for m, _ in lv)} devices but the cluster "
                         f"has {cluster.num_devices}")
    return lv


class _Antichains(NamedTuple):
    """main()'s graph: the antichain states PipeDream cuts between, and what was removed from the layers."""

    states: list[State]  # in topological order, with their sums
    preds: list[list[int]]  # all_predecessor_ids per state, in the order the DP scans them (tie_break)
    input_nodes: list[int]  # the Input sources removed (they join stage 0)
    inputs: list[list[int]]  # each layer's inputs


class _Tables(NamedTuple):
    """compute_partitioning's inputs: per states i..j (row i > 0 subtracts state i-1; None below the diagonal)."""

    compute_times: list  # s (each level substitutes its own times here for the next)
    activation_sizes: list  # bytes
    parameter_sizes: list  # bytes
    out_acts: list[float]  # bytes leaving each state


@profiled()  # never cuts where the profile forbids it; carries its tracing
def pipedream_plan(prof: Profile, cluster: Cluster, global_batch_size: int, micro_batch_size: int | None = None,
                   activation_transfer: bool = True, *, levels: Sequence[tuple[int, float]] | None = None,
                   minibatch_size: int | None = None, activation_compression_ratio: float = 1.0,
                   straight_pipeline: bool = False, use_fewer_machines: bool = False,
                   memory_constraint: bool = False, num_machines_in_first_level: int | None = None,
                   tie_break: str | int = "first", max_states: int = 512) -> Plan:
    """PipeDream's hierarchical planner as a baseline :class:`Plan` (same profile, same cluster).

    PipeDream's stages (antichain-state ranges with a replication factor per level, multiplied) go on
    consecutive device ids in stage order, as PipeDream's runtime ranks them, and onto the profile's layers: a
    stage owns the layers before its last cut that no earlier stage owns; ``Input`` sources join stage 0 (see
    ``meta["pipedream"]["moved_layers"]`` for a graph whose stages interleave in the layer order). PipeDream's
    estimate and raw solution are in ``plan.meta["pipedream"]`` (milliseconds); ``plan.estimate`` is left empty
    for dapple's own latency model to fill.

    Args:
        prof, cluster: the model's profile and the cluster.
        global_batch_size: samples per iteration of the Plan.
        micro_batch_size: PipeDream has no micro-batches; default: the minibatch when it divides the global
            batch and gives every replica of the widest stage a row, otherwise the smallest divisor of the
            global batch that does (preferring multiples of the minibatch).
        activation_transfer: count activation transfers (PipeDream's ``--activation_compression_ratio``).
        levels: (machines, bandwidth B/s) per level, innermost first, as PipeDream's ``-n 8 2 -b 5e10
            3.125e9``; default: the devices of a server over ``cluster.intra_bandwidth``, then the servers over
            ``cluster.inter_bandwidth``.
        minibatch_size: the batch whose per-layer costs PipeDream plans (default: the profile's largest, the
            batch a PipeDream graph.txt was profiled at).
        activation_compression_ratio, straight_pipeline, use_fewer_machines, num_machines_in_first_level:
            PipeDream's flags of those names.
        memory_constraint: ``--use_memory_constraint -s cluster.device_memory``.
        tie_break: PipeDream keeps the first of equally good splits in the iteration order of a Python set
            (memory addresses); "first" scans split points in ascending order, "last" descending, an int
            shuffles them with that seed.
        max_states: refuse graphs with more antichain states (the DP is cubic in their number).
    """
    t0 = time.perf_counter()
    lv = _check_args(prof, cluster, global_batch_size, micro_batch_size, minibatch_size, num_machines_in_first_level,
                     max_states, tie_break, activation_compression_ratio, levels)
    batch = minibatch_size or prof.batch_sizes[-1]
    ratio = float(activation_compression_ratio) if activation_transfer else None
    opts = dict(straight_pipeline=straight_pipeline, use_memory_constraint=memory_constraint,
                memory_size=cluster.device_memory, use_fewer_machines=use_fewer_machines,
                activation_compression_ratio=ratio)
    graph = _antichain_states(prof, batch, max_states, tie_break)
    tables = _tables(graph.states)
    all_As, level_times = _solve_levels(tables, graph.preds, lv, num_machines_in_first_level, opts)
    segments, levels_meta = _expand_splits(all_As, level_times, lv, tables, graph.states, ratio)
    ranges, moved = layer_ranges(_stage_of_layers(graph, segments, prof.num_layers), len(segments))
    stages = _on_devices(ranges, segments)
    micro_batch_size = _micro_batch(stages, global_batch_size, batch, micro_batch_size)
    S = len(graph.states)
    solution = {"pipeline_time_ms": 1e3 * all_As[-1][0][S - 1][lv[-1][0] - 1][0],
                "data_parallel_time_ms": 1e3 * _data_parallel_time(graph.states, lv), "num_states": S,
                "stages": [{**rec, "layers": list(rg), "replicas": r} for rec, rg, (_, _, r) in
                           zip(levels_meta[0]["stages"], ranges, segments)],
                "levels": levels_meta, "moved_layers": moved}
    meta = {"planner": "pipedream", "source": SOURCE, "model": prof.model, "cluster": cluster.name or str(cluster),
            "levels": [[m, bw] for m, bw in lv], "activation_transfer": bool(activation_transfer),
            "tie_break": tie_break, "minibatch_size": batch, "planning_s": round(time.perf_counter() - t0, 6),
            "pipedream": solution, "cluster_spec": cluster.to_dict(), **prof.source()}
    return Plan(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, stages=stages,
                schedule="dapple", layer_names=prof.layer_names, meta=meta)


def _on_devices(ranges: list[tuple[int, int]], segments: list[tuple[int, int, int]]) -> list[Stage]:
    """PipeDream's stages on consecutive device ids in stage order, as its runtime ranks them."""
    stages, dev = [], 0
    for (lo, hi), (_, _, r) in zip(ranges, segments):
        stages.append(Stage((lo, hi), list(range(dev, dev + r))))
        dev += r
    return stages


def _micro_batch(stages: list[Stage], global_batch_size: int, minibatch: int, micro_batch_size: int | None) -> int:
    """The Plan's micro-batch size: the one given (checked against the widest stage) or a default."""
    widest = max(s.replicas for s in stages)
    if micro_batch_size is None:
        return _default_micro(global_batch_size, minibatch, widest)
    if micro_batch_size < widest:
        raise ValueError(f"pipedream_plan: micro_batch_size {micro_batch_size} is smaller than the {widest} replicas "
                         f"of PipeDream's widest stage (each replica needs at least one row)")
    return micro_batch_size


def _check_args(prof: Profile, cluster: Cluster, global_batch_size: int, micro_batch_size: int | None,
                minibatch_size: int | None, num_machines_in_first_level: int | None, max_states: int,
                tie_break: str | int, activation_compression_ratio: float,
                levels: Sequence[tuple[int, float]] | None) -> list[tuple[int, float]]:
    """ValueError naming the first bad argument of pipedream_plan; else its levels, innermost first."""
    instance("pipedream_plan", "prof", prof, Profile)
    instance("pipedream_plan", "cluster", cluster, Cluster)
    for key, v in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size),
                   ("minibatch_size", minibatch_size), ("num_machines_in_first_level", num_machines_in_first_level),
                   ("max_states", max_states)):
        if (v is not None or key == "global_batch_size") and not is_int(v, 1):
            raise ValueError(f"pipedream_plan: {key} must be a positive integer, got {v!r}")
    if micro_batch_size is not None and global_batch_size % micro_batch_size:
        raise ValueError(f"pipedream_plan: global_batch_size {global_batch_size} is not divisible by "
                         f"micro_batch_size {micro_batch_size}")
    if not (tie_break in ("first", "last") or is_int(tie_break)):
        raise ValueError(f"pipedream_plan: tie_break must be 'first', 'last' or an integer seed, got {tie_break!r}")
    if not (is_real(activation_compression_ratio) and activation_compression_ratio > 0):
        raise ValueError(f"pipedream_plan: activation_compression_ratio must be a number > 0, got "
                         f"{activation_compression_ratio!r}")
    lv = cluster_levels(cluster) if levels is None else _check_levels(cluster, levels)
    if num_machines_in_first_level is not None and num_machines_in_first_level > lv[0][0]:
        raise ValueError(f"pipedream_plan: num_machines_in_first_level {num_machines_in_first_level} exceeds the "
                         f"{lv[0][0]} machines of level 1")
    return lv


def _antichain_states(prof: Profile, batch: int, max_states: int, tie_break: str | int) -> _Antichains:
    """main(): the graph with Input sources zeroed and removed and __getitem__ sinks removed, its states."""
    c, n, inputs = prof.costs(batch), prof.num_layers, _inputs(prof)
    act = layer_activation_sizes(prof, batch)
    compute_ms = [f + b for f, b in zip(c.forward_ms, c.backward_ms)]
    params = [float(p) for p in c.param_bytes]
    gr = Graph([_desc(x) for x in prof.layer_names], [(k, i) for i in range(n) for k in inputs[i]])
    input_nodes = [s for s in gr.sources() if gr.descs[s].startswith("Input")]
    for s in input_nodes:
        compute_ms[s] = act[s] = params[s] = 0.0
        gr.remove_node(s)
    for s in gr.sinks():
        if gr.descs[s].startswith("__getitem__"):
            gr.remove_node(s)
    if not gr.nodes:
        raise ValueError(f"pipedream_plan: nothing to plan in {prof.model}: every layer is an Input source")
    states, preds = build_states(gr, compute_ms, act, params, max_states)
    if tie_break == "last":
        preds = [p[::-1] for p in preds]
    elif not isinstance(tie_break, str):
        rng = random.Random(tie_break)
        preds = [rng.sample(p, len(p)) for p in preds]
    return _Antichains(states, preds, input_nodes, inputs)


def _tables(states: list[State]) -> _Tables:
    """The sums of states i..j that compute_partitioning reads."""
    S = len(states)

    def table(v: list[float]) -> list[list[float | None]]:
        return [[(v[j] - (v[i - 1] if i else 0.0)) if j >= i else None for j in range(S)] for i in range(S + 1)]

    return _Tables(table([s.compute_time for s in states]), table([s.activation_size for s in states]),
                   table([s.parameter_size for s in states]), [s.output_activation_size for s in states])


def _solve_levels(tables: _Tables, preds: list[list[int]], lv: list[tuple[int, float]],
                  num_machines_in_first_level: int | None, opts: dict) -> tuple[list, list]:
    """main(): each level's DP, innermost first, its times substituted into the next level's compute times.
    Returns (A per level, the compute times each level planned with)."""
    compute_times, S = tables.compute_times, len(tables.out_acts)
    all_As, level_times, within = [], [], 1
    for lvl, (machines, bw) in enumerate(lv):
        A = compute_partitioning(compute_times, tables.activation_sizes, tables.parameter_sizes, tables.out_acts,
                                 preds, machines, within, num_machines_in_first_level, bw,
                                 final_level=lvl == len(lv) - 1, opts=opts)
        level_times.append([row[:] for row in compute_times])  # what this level planned with
        within = machines
        for i in range(S + 1):  # this level's times substituted upward
            for j in range(S):
                compute_times[i][j] = A[i][j][-1][0]
        all_As.append(A)
    return all_As, level_times


def _expand_splits(all_As: list, level_times: list, lv: list[tuple[int, float]], tables: _Tables,
                   states: list[State], ratio: float | None) -> tuple[list[tuple[int, int, int]], list[dict]]:
    """main(): the splits expanded top-down; a stage's replication factors multiply over the levels. Returns
    ((state start, state end, replicas) per stage, each level's record for ``meta["pipedream"]["levels"]``)."""
    segments, levels_meta = [(0, len(states), 1)], []
    for lvl in reversed(range(len(lv))):
        machines, bw = lv[lvl]
        new, rec = [], []
        for start, end, mult in segments:
            splits, factors = analyze_partitioning(all_As[lvl], start, end, machines)
            bounds = [start] + splits + [end]
            for s, e, r in zip(bounds, bounds[1:], factors):
                new.append((s, e, mult * r))
                # the stage's value in this level's DP: a segment's first stage is an initial data-parallel
                # entry (AllReduce term divided by the machines within a machine), later ones are not
                inner = (lv[lvl - 1][0] if lvl else 1) if s == start else 1
                rec.append(_stage_record(level_times[lvl], tables, states, s, e, r, bw, inner, ratio))
        segments = new
        levels_meta.append({"level": lvl + 1, "machines": machines, "bandwidth": bw, "stages": rec})
    levels_meta.reverse()
    return segments, levels_meta


def _stage_record(times: list, tables: _Tables, states: list[State], s: int, e: int, r: int, bw: float, inner: int,
                  ratio: float | None) -> dict:
    """One stage of one level as PipeDream prints it: states [s, e) on r replicas, its times in ms."""
    xfer = 0.0 if ratio is None else 1e3 * 2.0 / (bw * r * ratio)
    out_acts = tables.out_acts
    return {"states": [s, e], "replicas": r,
            "time_ms": 1e3 * dp_time(times[s][e - 1], tables.parameter_sizes[s][e - 1], r, bw, inner),
            "compute_ms": 1e3 * compute_times_raw(states, s, e),
            "input_transfer_ms": xfer * out_acts[s - 1] if s else 0.0,
            "output_transfer_ms": xfer * out_acts[e - 1] if e < len(states) else 0.0}


def _stage_of_layers(graph: _Antichains, segments: list[tuple[int, int, int]], n: int) -> list[int]:
    """main(): a stage owns the nodes before its last cut that no earlier stage owns; Input sources join stage 0,
    removed __getitem__ sinks their producer's stage."""
    stage_of: list[int | None] = [None] * n
    for sid, (_, e, _) in enumerate(segments):
        mask = graph.states[e - 1].predecessors
        for v in range(n):
            if stage_of[v] is None and (mask >> v) & 1:
                stage_of[v] = sid
    for s in graph.input_nodes:
        stage_of[s] = 0
    for v in range(n):
        if stage_of[v] is None:
            stage_of[v] = max([x for x in (stage_of[k] for k in graph.inputs[v]) if x is not None], default=0)
    return stage_of  # type: ignore[return-value]


def compute_times_raw(states: list[State], s: int, e: int) -> float:
    """Seconds of forward + backward of states [s, e) (analyze_partitioning's per-stage compute time)."""
    return states[e - 1].compute_time - (states[s - 1].compute_time if s else 0.0)


def layer_ranges(stage_of: list[int], num_stages: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Contiguous [start, end) per stage from a stage id per layer; where the stages interleave in the layer
    order (a DAG), each stage keeps its number of layers and the layers that changed stage are returned."""
    ranges, lo = [], 0
    for s in range(num_stages):
        cnt = stage_of.count(s)
        ranges.append((lo, lo + cnt))
        lo += cnt
    return ranges, [v for v, s in enumerate(stage_of) if not ranges[s][0] <= v < ranges[s][1]]


def _default_micro(global_batch: int, minibatch: int, widest: int) -> int:
    divisors = [d for d in range(widest, global_batch + 1) if global_batch % d == 0]
    if not divisors:
        raise ValueError(f"pipedream_plan: PipeDream's widest stage has {widest} replicas, more than the global "
                         f"batch of {global_batch} rows (each replica needs a row); give a larger global_batch_size")
    return next((d for d in divisors if d % minibatch == 0), divisors[0])


def _data_parallel_time(states: list[State], lv: list[tuple[int, float]]) -> float:
    """main()'s data_parallel_total_time: every level purely data-parallel."""
    total, params, within = states[-1].compute_time, states[-1].parameter_size, 1
    for machines, bw in lv:
        total = dp_time(total, params, machines, bw, within)
        within = machines
    return total
