"""dapple: synchronous pipelined data-parallel training for PyTorch (the DAPPLE approach)."""

from . import planner, profiler
from .planner import Cluster, Plan, evaluate, plan, simulate
from .profiler import Profile

__version__ = "0.1.0"

__all__ = ["Cluster", "Plan", "Profile", "evaluate", "plan", "planner", "profiler", "simulate"]
