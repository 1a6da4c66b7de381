"""The planner: cluster model, pivot-stage latency model, Fresh/Append/Scatter placement, DP search."""

from ..core.cluster import Cluster
from ..core.plan import Estimate, Plan, Stage
from ..core.schedule import Op, stage_ops, warmup_counts
from .evaluate import evaluate
from .gantt import draw_plan
from .pipedream import pipedream_plan
from .planning import plan
from .simulator import SimResult, simulate

__all__ = ["Cluster", "Estimate", "Op", "Plan", "SimResult", "Stage", "draw_plan", "evaluate", "pipedream_plan",
           "plan", "simulate", "stage_ops", "warmup_counts"]
