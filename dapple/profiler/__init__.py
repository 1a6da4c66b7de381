"""The profiler: torch.fx tracing, layer grouping, per-layer times and sizes (a Profile)."""

from .layers import LayerGraph, trace_layers
from .profile import LayerCosts, LayerProfile, Profile
from .trace import TraceError

__all__ = ["LayerCosts", "LayerGraph", "LayerProfile", "Profile", "TraceError", "trace_layers"]
