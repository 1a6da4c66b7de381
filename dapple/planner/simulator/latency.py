"""A simulated iteration as a Latency (Tw, Ts, Te, pivot): how the refined model answers for a split backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..model.pivot import Latency
from .events import simulate

if TYPE_CHECKING:
    from ...core.cluster import Cluster
    from ...core.plan import Plan
    from ...core.profile import Profile


def simulated_latency(plan: "Plan", profile: "Profile", cluster: "Cluster", overlap: bool) -> Latency:
    """``plan``'s simulated iteration, split as formula 2 splits it on the stage that finishes last (the pivot):
    until its first backward starts (Tw), from there to the end of its last forward (Ts), the rest (Te).

    Args:
        plan, profile, cluster: as :func:`events.simulate`.
        overlap: AllReduce overlapped with the last backward.
    """
    sim = simulate(plan, profile, cluster, overlap=overlap)
    if not sim.ops:
        return Latency(0.0, 0.0, sim.latency_ms, 0)
    last = max(sim.ops, key=lambda o: o.end_ms)
    mine = [o for o in sim.ops if o.device == last.device and o.kind in ("F", "B", "W")]
    first_b = min((o.start_ms for o in mine if o.kind != "F"), default=0.0)
    last_f = max((o.end_ms for o in mine if o.kind == "F"), default=first_b)
    warmup = first_b
    steady = max(0.0, last_f - first_b)
    return Latency(warmup, steady, sim.latency_ms - warmup - steady, 2 * last.stage)
