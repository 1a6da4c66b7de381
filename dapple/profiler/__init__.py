"""The profiler: torch.fx tracing, layer grouping, per-layer times and sizes (a Profile)."""

from ..core.profile import LayerCosts, LayerProfile, Profile
from .fx_trace import TraceError
from .layer_graph import LayerGraph
from .layers import trace_layers

__all__ = ["LayerCosts", "LayerGraph", "LayerProfile", "Profile", "TraceError", "trace_layers"]
