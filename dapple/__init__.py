"""dapple: synchronous pipelined data-parallel training for PyTorch (the DAPPLE approach)."""

from . import planner, profiler
from .planner import Cluster, Plan
from .profiler import Profile
from .profiler.api import profile
from .runtime import Pipeline, pipeline

__version__ = "0.1.0"

__all__ = ["Cluster", "Pipeline", "Plan", "Profile", "pipeline", "planner", "profile", "profiler"]
