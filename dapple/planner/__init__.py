"""The planner: cluster model, pivot-stage latency model, Fresh/Append/Scatter placement, DP search."""

from .cluster import Cluster
from .pipedream import pipedream_plan
from .plan import Estimate, Plan, Stage
from .schedule import Op, stage_ops, warmup_counts

__all__ = ["Cluster", "Estimate", "Op", "Plan", "Stage", "pipedream_plan", "stage_ops", "warmup_counts"]
