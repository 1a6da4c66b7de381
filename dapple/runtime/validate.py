"""Checks of a plan against the world and the model, run before any work; errors name values."""

# each step's batch is checked by rank_batch.py on each rank and batch_check.py across the ranks

from __future__ import annotations

from typing import Any

from ..core.plan import Plan
from ..core.schedule import validate_warmup


def check_plan(plan: Any, world_size: int) -> None:
    """The plan is a valid Plan for a world of ``world_size`` ranks, every rank in exactly one stage."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a dapple.Plan (e.g. dapple.Plan.load('plan.yaml')), got "
                        f"{type(plan).__name__}")
    plan.validate()  # contiguous layer ranges from 0, device ids 0..n-1 each in one stage, batch divisibility
    if plan.num_devices != world_size:
        raise ValueError(f"plan needs {plan.num_devices} ranks, world has {world_size} (launch with "
                         f"torchrun --nproc_per_node={plan.num_devices}, or make a plan for {world_size} devices)")
    validate_warmup(plan.warmup, plan.num_micro_batches)


def layout_mismatch(plan: Plan, local_world_size: int | None) -> str | None:
    """Why the plan's placement will not hold on this job, or None: it was made for servers of
    ``devices_per_server`` devices (``meta["cluster_spec"]``, which dapple.plan records) and this job runs
    ``local_world_size`` ranks per node (torchrun's LOCAL_WORLD_SIZE; None: not known). Ranks then map to other
    servers than planned: the run stays correct, but the stages' transfers and AllReduces cross other links."""
    spec = plan.meta.get("cluster_spec")
    if not isinstance(spec, dict) or local_world_size is None:
        return None
    per = spec.get("devices_per_server")
    if not isinstance(per, int) or per == local_world_size or plan.num_devices <= min(per, local_world_size):
        return None  # (every rank on one server either way)
    return (f"plan was made for servers of {per} devices ({spec.get('servers')} x {per}, meta.cluster_spec) but "
            f"this job runs {local_world_size} ranks per node (LOCAL_WORLD_SIZE): its stages sit on other servers "
            f"than planned and its estimate does not hold; plan for devices_per_server={local_world_size}")
