"""Exhaustive search over every stage split and device assignment: the DP's oracle on small clusters."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterator, NamedTuple

from ...core.schedule import warmup_counts
from ..model.cost import CostModel, ServerLayout, Span
from ..model.evaluate import PipelineCosts, pipeline_costs
from ..model.memory import NoFitError
from ..search.exact import Layouts, compositions

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.profile import Profile


class PricedPlan(NamedTuple):
    """One plan of :func:`every_plan`."""

    spans: tuple[Span, ...]  # (layer start, layer end, server layout) per stage
    costs: PipelineCosts  # with policy A's K_i
    fits: list[int]  # D per stage: micro-batch slices in flight that fit in memory


class Optimum(NamedTuple):
    """What :func:`exhaustive_search` found."""

    latency: float  # ms (inf: no plan fits)
    spans: tuple[Span, ...]
    warmup_policy: str


def assignments(cluster: "Cluster", stages: int, max_replicas: int) -> Iterator[tuple[ServerLayout, ...]]:
    """Every way to give ``stages`` stages all devices (each stage a non-empty ordered list of at most
    ``max_replicas`` devices), as server layouts, without repeats (devices of a server are interchangeable; every
    labelling of the servers: search.exact.Layouts, the enumerator the certificates walk once per relabelling)."""
    layouts = Layouts(cluster.servers)
    for counts in compositions(cluster.num_devices, stages, max_replicas):
        yield from layouts.assignments(counts, cluster.devices_per_server, labelled=True)


def every_plan(profile: "Profile", cluster: "Cluster", M: int, cm: CostModel,
               max_stages: int | None = None, endings: bool = True) -> Iterator[PricedPlan]:
    """Every plan that fits in memory: all layer splits x device assignments that use every device, with at
    most ``max_stages`` stages (``endings``: with each stage's overlapped AllReduce ending priced, see
    pipeline_costs)."""
    N, G, b = profile.num_layers, cluster.num_devices, cm.micro
    for S in range(1, min(N, G, G if max_stages is None else max_stages) + 1):
        lays_all = list(assignments(cluster, S, b))
        for cuts in itertools.combinations(range(1, N), S - 1):
            bounds = (0,) + cuts + (N,)
            for lays in lays_all:
                spans = tuple(Span(bounds[i], bounds[i + 1], lays[i]) for i in range(S))
                try:
                    pc, D = pipeline_costs(cm, spans, M, "A", endings=endings)
                except NoFitError:
                    continue
                yield PricedPlan(spans, pc, D)


def exhaustive_search(profile: "Profile", cluster: "Cluster", global_batch_size: int, micro_batch_size: int, *,
                      model: str = "paper", overlap: bool = False, warmup_policy: str | None = None,
                      optimizer_factor: float = 4.0, max_stages: int | None = None) -> Optimum:
    """The best plan over all layer splits x device assignments that use every device (what the DP
    approximates). Feasible only for a handful of devices and layers.

    Args:
        profile, cluster, global_batch_size, micro_batch_size: the instance.
        model, overlap: the latency model, as :func:`dapple.planner.evaluate`.
        warmup_policy: the policy to price under the refined model (default: the better of A and B; the paper
            model prices A).
        optimizer_factor: static bytes per parameter byte.
        max_stages: the deepest pipeline tried.
    """
    M = global_batch_size // micro_batch_size
    cm = CostModel(profile, cluster, micro_batch_size, optimizer_factor=optimizer_factor)
    best = Optimum(float("inf"), (), "A")
    for spans, pc, D in every_plan(profile, cluster, M, cm, max_stages, endings=overlap):
        for pol in ((warmup_policy,) if warmup_policy else ("A", "B")) if model == "refined" else ("A",):
            pc.K = warmup_counts(len(spans), M, pol, max_in_flight=D)
            t = pc.latency(model, overlap).total
            if t < best.latency - 1e-9:
                best = Optimum(t, spans, pol)
    return best
