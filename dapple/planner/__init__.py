"""The planner: cluster model, pivot-stage latency model, Fresh/Append/Scatter placement, DP search."""

from ..core.cluster import Cluster
from ..core.plan import Estimate, Plan, Stage
from ..core.schedule import Op, stage_ops, warmup_counts
from .baselines.pipedream import pipedream_plan
from .model.evaluate import evaluate
from .model.memory import NoFitError, memory_needed
from .planning import plan
from .simulator.events import SimResult, simulate
from .simulator.gantt import draw_plan

__all__ = ["Cluster", "Estimate", "NoFitError", "Op", "Plan", "SimResult", "Stage", "draw_plan", "evaluate",
           "memory_needed", "pipedream_plan", "plan", "simulate", "stage_ops", "warmup_counts"]
