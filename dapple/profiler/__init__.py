"""The profiler: torch.fx tracing, layer grouping, per-layer times and sizes (a Profile)."""

from ..core.profile import LayerCosts, LayerProfile, Profile
from ..core.trace_spec import InputSpec, TraceSpec
from .fx_trace import TraceError
from .layer_graph import LayerGraph
from .layers import trace_layers

__all__ = ["InputSpec", "LayerCosts", "LayerGraph", "LayerProfile", "Profile", "TraceError", "TraceSpec",
           "trace_layers"]
