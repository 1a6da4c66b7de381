"""The refit documents: a Profile whose layers take the measured time, a Cluster whose links and AllReduce do."""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from ..core.profile import LayerProfile, Profile
from ..planner.simulator.split import WEIGHT_SHARE
from .fit import LinkFit, Scale

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.plan import Plan


@dataclass(frozen=True)
class LayerScale:
    """How one run measured a layer: the scales of the stage it was in, that stage's layer count, ops measured."""

    forward: float
    backward: float  # input gradients (the whole backward unless the schedule split it)
    weight: float  # weight gradients (= backward unless split)
    stage_layers: int
    ops: int


def layer_scales(plan: "Plan", found: Sequence[Scale]) -> dict[int, LayerScale]:
    """Each layer's :class:`LayerScale` from the per-stage scales of a run of ``plan`` (a stage with no measured
    op of a kind keeps 1 for it; a split backward's first stage, whose B is empty, scales its backward by W's)."""
    by = {(s.stage, s.kind): s for s in found}
    out = {}
    for i, st in enumerate(plan.stages):
        f, b, w = (by.get((i, k)) for k in ("F", "B", "W"))
        fs = f.scale if f else 1.0
        bs = b.scale if b else (w.scale if w else 1.0)
        ws = w.scale if w else bs
        ops = sum(x.ops for x in (f, b, w) if x)
        a, c = st.layers
        for layer in range(a, c):
            out[layer] = LayerScale(fs, bs, ws, c - a, ops)
    return out


def combined(per_run: Sequence[dict[int, LayerScale]], num_layers: int) -> list[LayerScale]:
    """Per layer, the runs' scales averaged with their ops as weights (a layer no run measured: 1)."""
    out = []
    for layer in range(num_layers):
        seen = [r[layer] for r in per_run if layer in r and r[layer].ops > 0]
        if not seen:
            out.append(LayerScale(1.0, 1.0, 1.0, 1, 0))
            continue
        total = sum(s.ops for s in seen)

        def avg(key: str) -> float:
            return sum(getattr(s, key) * s.ops for s in seen) / total
        out.append(LayerScale(avg("forward"), avg("backward"), avg("weight"), max(1, round(avg("stage_layers"))),
                              total))
    return out


def _scaled(v: float, s: float, call: float, n: int) -> float:
    """A layer time ``v`` scaled by ``s`` so that its stage of ``n`` layers, which pays ``call`` once, takes ``s``
    times as long: ``s v - (s - 1)(n - 1) call / n`` (never below 0)."""
    return max(0.0, s * v - (s - 1.0) * (n - 1) * call / n)


def scaled_layer(layer: LayerProfile, s: LayerScale, call: tuple[float, float], overhead_ms: float) -> LayerProfile:
    """``layer`` with its forward and backward scaled (a split backward: its input- and weight-gradient parts
    each by their own scale), plus ``overhead_ms`` per op, which the stage also pays once in ``call_ms``."""
    f0, b0 = call
    n = s.stage_layers
    forward = [_scaled(v, s.forward, f0, n) + overhead_ms for v in layer.forward_ms]
    weight = layer.weight_ms
    if s.weight == s.backward:  # one scale for the whole backward; a measured weight share is kept
        backward = [_scaled(v, s.backward, b0, n) for v in layer.backward_ms]
        if weight is not None:
            weight = [w * (b / v if v > 0 else 0.0) for w, b, v in zip(weight, backward, layer.backward_ms)]
    else:  # split: each part by its own scale, the call cost shared as the parts share the backward
        base = weight if weight is not None else [WEIGHT_SHARE * v for v in layer.backward_ms]
        weight, backward = [], []
        for v, w in zip(layer.backward_ms, base):
            share = w / v if v > 0 else WEIGHT_SHARE
            wi = _scaled(w, s.weight, b0 * share, n)
            weight.append(wi)
            backward.append(wi + _scaled(v - w, s.backward, b0 * (1 - share), n))
    backward = [v + overhead_ms for v in backward]
    if weight is not None:
        weight = [min(w, b) for w, b in zip(weight, backward)]
    return replace(layer, forward_ms=forward, backward_ms=backward, weight_ms=weight)


def calibrated_profile(profile: Profile, per_layer: Sequence[LayerScale], overhead_ms: float, step_ms: float,
                       meta: dict) -> Profile:
    """A new Profile: every layer scaled (:func:`scaled_layer`), ``call_ms`` raised by the per-op overhead (so
    the layers' net times stay as scaled and each stage op pays it once), ``step_ms`` as measured,
    ``meta["calibration"] = meta``."""
    call = (float(profile.call_ms[0]), float(profile.call_ms[1]))
    layers = [scaled_layer(layer, s, call, overhead_ms) for layer, s in zip(profile.layers, per_layer)]
    out_meta = copy.deepcopy(profile.meta)
    out_meta["calibration"] = meta
    return Profile(model=profile.model, device=profile.device, batch_sizes=list(profile.batch_sizes), layers=layers,
                   meta=out_meta, call_ms=[call[0] + overhead_ms, call[1] + overhead_ms], step_ms=step_ms)


def calibrated_cluster(cluster: "Cluster", links: dict[str, LinkFit], allreduce: dict[tuple[int, bool], float],
                       meta: dict) -> "Cluster":
    """A new Cluster with the fitted links (``links["intra"|"inter"]``) and AllReduce: per (group size, spans
    servers), the ring's latency x factor and bandwidth / factor; inside a server written per group size when
    the cluster has such a table or several sizes were measured, else as its one intra AllReduce."""
    doc = cluster.to_dict()
    for kind in ("intra", "inter"):
        fit = links.get(kind)
        if fit is not None and fit.method != "unchanged":
            doc[f"{kind}_latency"], doc[f"{kind}_bandwidth"] = fit.latency, fit.bandwidth
    table = {int(r): list(v) for r, v in (cluster.intra_allreduce_by_size or {}).items()}
    intra = {r: k for (r, spans), k in allreduce.items() if not spans}
    for (r, spans), k in sorted(allreduce.items()):
        bw, lat = cluster.allreduce_link(spans_servers=spans, replicas=r)
        if spans:
            doc["inter_allreduce_latency"], doc["inter_allreduce_bandwidth"] = lat * k, bw / k
        elif table or len(intra) > 1:
            table[r] = [lat * k, bw / k]
        else:
            doc["intra_allreduce_latency"], doc["intra_allreduce_bandwidth"] = lat * k, bw / k
    if table:
        doc["intra_allreduce_by_size"] = dict(sorted(table.items()))
    doc["meta"] = {**copy.deepcopy(cluster.meta), "calibration": meta}
    return type(cluster).from_dict(doc, where="calibrated cluster")


def median_or_zero(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
