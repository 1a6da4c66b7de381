"""The documents every phase shares: Profile, Cluster, Plan, schedules (K_i), split-concat routes, timelines."""

from .cluster import Cluster
from .plan import Estimate, Plan, Stage
from .profile import LayerCosts, LayerProfile, Profile
from .schedule import Op, stage_ops, warmup_counts
from .split_concat import Route, routes, slice_bounds
from .timeline import Event
from .trace_spec import InputSpec, TraceSpec

__all__ = ["Cluster", "Estimate", "Event", "InputSpec", "LayerCosts", "LayerProfile", "Op", "Plan", "Profile", "Route",
           "Stage", "TraceSpec", "routes", "slice_bounds", "stage_ops", "warmup_counts"]
