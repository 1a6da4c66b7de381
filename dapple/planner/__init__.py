"""The planner: cluster model, pivot-stage latency model, Fresh/Append/Scatter placement, DP search."""

from .cluster import Cluster
from .evaluate import evaluate
from .gantt import draw_plan
from .pipedream import pipedream_plan
from .plan import Estimate, Plan, Stage
from .planning import plan
from .schedule import Op, stage_ops, warmup_counts
from .simulator import SimResult, simulate

__all__ = ["Cluster", "Estimate", "Op", "Plan", "SimResult", "Stage", "draw_plan", "evaluate", "pipedream_plan",
           "plan", "simulate", "stage_ops", "warmup_counts"]
