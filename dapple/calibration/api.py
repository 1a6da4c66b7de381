"""``dapple.calibrate``: the Profile and Cluster refit to what a running job's traced steps measured."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Sequence

from ..planner import evaluate, simulate
from . import fit, samples
from .apply import calibrated_cluster, calibrated_profile, combined, layer_scales, median_or_zero
from .traces import TracedRun, TraceLike, traced_runs

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.plan import Plan
    from ..core.profile import Profile


def calibrate(profile: "Profile", cluster: "Cluster", traces: TraceLike | Sequence[TraceLike], *,
              skip: int = 0) -> tuple["Profile", "Cluster"]:
    """Fit ``profile`` and ``cluster`` to the measured steps in ``traces``.

    From each trace (its plan is in its metadata) the documents' model of every op, transfer and AllReduce is
    set beside what was measured:

    - compute: per stage and kind (F, B, and W under a split backward), the measured time of a step's ops over
      the modelled time, its slowest replica's, median over steps; each layer of the stage is scaled by it (a
      stage's layers share its ratio; the per-op call cost a stage pays once is kept once). The runtime's own
      time that delays the pipeline (the compute lane's uncovered time right before an op, and after one until
      its sends are posted; per op, median over ranks and steps) is added to every op through ``call_ms``, and
      its fixed cost per step (checks before the
      first op; the loss AllReduce, tied parameters' AllReduce and last sends after the last: the step's span
      less its work, median over steps) becomes ``step_ms``.
    - links, per class (inside a server, between servers): ``seconds = latency + bytes / bandwidth`` by least
      squares over the messages whose receiver was already waiting when the sender posted them (from the post to
      the delivery; other receives may have waited on the peer's compute or not at all); with one message size,
      the model's latency and 1/bandwidth scaled by measured / modelled.
    - AllReduce, per group size (and whether it spans servers): one factor on the ring model's time, such that
      the step's buckets, run one after another from their measured launches, end when the measured last one
      did (median over steps).

    Several traces (e.g. of several plans) are pooled: a layer's scales are averaged over them, weighted by the
    ops measured. ``meta["calibration"]`` of each document records its provenance: the traces and plans, steps,
    fitted values, and per trace the measured median step against the refined estimate and the simulator before
    and after.

    Args:
        profile, cluster: the documents the running plan was made with (or any for the same model and machine).
        traces: a trace or a list of them: Chrome-trace files written by ``Trace.save`` / ``Pipeline.save_trace``,
            their JSON documents, or the ``(events, meta)`` that ``Trace.gather()`` returns on rank 0.
        skip: leave out each trace's first ``skip`` steps.

    Returns:
        ``(profile, cluster)``: new documents; the arguments are not changed.

    Raises:
        ValueError: a trace without a plan, a plan for other layers than the profile's or more devices than the
            cluster's, or of several chunks per device.
    """
    runs = traced_runs(traces, skip)
    per_layer, gaps, fixed, messages = [], [], [], []
    ar_classes: dict[tuple[int, bool], list[samples.Reduction]] = {}
    stage_meta = []
    for run in runs:
        _check(run, profile, cluster)
        modelled = samples.modelled_ops(simulate(run.plan, profile, cluster))
        found = fit.scales(samples.op_ratios(run, modelled))
        per_layer.append(layer_scales(run.plan, found))
        stage_meta.append([{"stage": s.stage, "kind": s.kind, "scale": round(s.scale, 4), "ops": s.ops}
                           for s in found])
        gaps += samples.gaps_per_op(run)
        fixed += samples.step_overheads(run)
        messages += samples.transfers(run, cluster)
        for r in samples.reductions(run, cluster):
            ar_classes.setdefault((r.replicas, r.spans_servers), []).append(r)
    overhead, step_ms = median_or_zero(gaps), median_or_zero(fixed)
    links = {kind: fit.fit_link([m for m in messages if m.link == kind], *_link(cluster, kind))
             for kind in ("intra", "inter")}
    factors = _allreduce_factors(cluster, ar_classes)
    common = {"traces": [run.source for run in runs], "steps": [run.steps for run in runs]}
    prof = calibrated_profile(profile, combined(per_layer, profile.num_layers), overhead, step_ms, {
        **common, "base_profile": profile.path or profile.model, "stages": stage_meta,
        "overhead_ms_per_op": round(overhead, 4), "step_ms": round(step_ms, 4),
        "plans": [run.plan.to_dict() for run in runs]})
    clus = calibrated_cluster(cluster, links, factors, {
        **common, "links": {k: _link_meta(v) for k, v in links.items()},
        "allreduce": [{"replicas": r, "spans_servers": s, "factor": round(k, 4),
                       "samples": sum(len(v) for (n, t), v in ar_classes.items() if t == s and (s or n == r))}
                      for (r, s), k in sorted(factors.items())]})
    accuracy = [accuracy_of(run, profile, cluster, prof, clus) for run in runs]
    prof.meta["calibration"]["accuracy"] = clus.meta["calibration"]["accuracy"] = accuracy
    return prof, clus


def accuracy_of(run: TracedRun, before_prof: "Profile", before_cluster: "Cluster", after_prof: "Profile",
                after_cluster: "Cluster") -> dict[str, Any]:
    """A run's measured median step and, before and after calibration, the refined estimate and the simulator's
    step (the AllReduce overlapped with the last backward, as the runtime runs it) with their errors."""
    measured = run.median_step_ms()
    out: dict[str, Any] = {"trace": run.source, "measured_ms": round(measured, 3)}
    for when, p, c in (("before", before_prof, before_cluster), ("after", after_prof, after_cluster)):
        for name, value in predictions(run.plan, p, c).items():
            out[f"{name}_{when}_ms"] = None if value is None else round(value, 3)
            out[f"{name}_{when}_error"] = None if value is None else round(value / measured - 1, 4)
    return out


def predictions(plan: "Plan", profile: "Profile", cluster: "Cluster") -> dict[str, float | None]:
    """``{"estimate": refined model ms, "simulated": simulator ms}`` of ``plan`` with overlapped AllReduce (None
    where the model refuses the plan, e.g. it does not fit in device memory)."""
    out: dict[str, float | None] = {}
    try:
        out["estimate"] = evaluate(profile, cluster, plan, model="refined", overlap=True).latency_ms
    except ValueError:
        out["estimate"] = None
    out["simulated"] = simulate(plan, profile, cluster, overlap=True).latency_ms
    return out


def _check(run: TracedRun, profile: "Profile", cluster: "Cluster") -> None:
    plan = run.plan
    plan.check_layers(profile.layer_names, f"the profile of {profile.model}")
    if plan.num_layers != profile.num_layers:
        raise ValueError(f"calibrate: {run.source}: its plan covers {plan.num_layers} layers, the profile of "
                         f"{profile.model} has {profile.num_layers}")
    chunked = [d for d in range(plan.num_devices) if len(plan.stages_of_device(d)) > 1]
    if chunked:  # the samples pair each rank's ops with one stage's model
        raise ValueError(f"calibrate: {run.source}: its plan puts several chunks on a device (device {chunked[0]}: "
                         f"{plan.device_label(chunked[0])}); calibration reads traces of one stage per device")
    if plan.num_devices > cluster.num_devices:
        raise ValueError(f"calibrate: {run.source}: its plan uses {plan.num_devices} devices, the cluster has "
                         f"{cluster.num_devices}")


def _link(cluster: "Cluster", kind: str) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of a link class."""
    return getattr(cluster, f"{kind}_latency"), getattr(cluster, f"{kind}_bandwidth")


def _allreduce_factors(cluster: "Cluster", classes: dict[tuple[int, bool], list]) -> dict[tuple[int, bool], float]:
    """Per group size inside a server, and once for every group spanning servers (the Cluster holds one such
    AllReduce model; keyed by the largest size seen): the factor on the ring model's time (fit.allreduce_factor)."""
    out = {}
    for (r, spans), rs in classes.items():
        if not spans and (k := fit.allreduce_factor([(x, _ring(cluster, r, False)) for x in rs])) is not None:
            out[(r, False)] = k
    spanning = [(x, _ring(cluster, r, True)) for (r, spans), rs in classes.items() if spans for x in rs]
    if (k := fit.allreduce_factor(spanning)) is not None:
        out[(max(r for (r, s) in classes if s), True)] = k
    return out


def _ring(cluster: "Cluster", r: int, spans: bool):
    """bytes -> seconds of a ring AllReduce over ``r`` devices, as the cost model prices it."""
    bw, lat = cluster.allreduce_link(spans_servers=spans, replicas=r)
    return lambda nbytes: 2 * (r - 1) / r * nbytes / bw + 2 * (r - 1) * lat


def _link_meta(f: fit.LinkFit) -> dict:
    d = {"latency_s": f.latency, "bandwidth_Bps": f.bandwidth, "samples": f.samples, "method": f.method}
    if f.measured_s is not None:
        d.update(measured_median_s=f.measured_s, modelled_median_s=f.modelled_s)
    return d


def median_step_ms(traces: TraceLike | Sequence[TraceLike], skip: int = 0) -> float:
    """The median step (ms) over every step of ``traces``: per step, the earliest start to the latest end of the
    ranks' ``train_step`` spans."""
    return statistics.median(v for run in traced_runs(traces, skip) for v in run.step_ms().values())
