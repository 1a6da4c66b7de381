"""A stage replica's process groups and P2P channels, created in one order on every rank and checked before a step."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..core.dist import bounded, group_timeout
from ..core.plan import Plan
from .distributed import DistContext
from .groups import GradGroup, GradReducer, make_grad_groups, start_equal
from .p2p import P2P
from .program import Transfer, cut_routes
from .roll import waited
from .stages import StageGraph


class Channels(NamedTuple):
    """Everything this rank communicates through."""

    groups: list[GradGroup]  # the gradient AllReduce groups this rank belongs to
    reducer: GradReducer  # the bucketed gradient AllReduce over them
    p2p: P2P  # activations and gradients between stages


def open_channels(plan: Plan, graphs: Sequence[StageGraph], names: dict[int, str], ctx: DistContext, who: str,
                  timeout: float, value_name: Callable[[Transfer], str], *,
                  reduce_dtype: torch.dtype | None = None) -> Channels:
    """Create the process groups every rank creates, in the same order: the gradients' P2P group (several
    stages), then the gradient AllReduce groups; every step is bounded by ``timeout``.

    Args:
        plan: the plan every rank runs.
        graphs: every stage of the split model (each rank needs them all to create every group).
        names: id(parameter) -> its canonical name in the original model.
        ctx: this rank and its device.
        who: this rank and its stage(s), for messages ("rank 2 (stage 1)").
        timeout: seconds each group creation and later wait is bounded by.
        value_name: a transfer's boundary value, named for messages.
        reduce_dtype: the dtype gradients travel in for the AllReduce (None: their own).
    """
    where = f"{who}: dapple.pipeline"
    grad_p2p = bounded(timeout, f"{where}: creating the gradients' group of every rank (does every rank call "
                       f"dapple.pipeline with the same plan?)", dist.new_group, list(range(ctx.world_size)),
                       timeout=group_timeout(timeout, ctx.backend)) if plan.num_stages > 1 else None
    groups = make_grad_groups(plan, graphs, names, ctx.rank, timeout, where)
    start_equal(groups, timeout, who)
    # early backward: stage i runs K_i forwards ahead of its backwards (what lets P2P free delivered sends early)
    ahead = (lambda s: plan.stages[s].warmup) if plan.schedule == "dapple" else (lambda s: None)
    p2p = P2P(ctx.rank, plan.device_label, None, grad_p2p, timeout, value_name, ahead)
    return Channels(groups, GradReducer(groups, reduce_dtype=reduce_dtype), p2p)


def handshake(plan: Plan, ctx: DistContext, who: str, channels: Channels, timeout: float) -> None:
    """One tiny message on every channel this rank uses, in a global order, before the first step.

    Checks that every peer is reachable (bounded by the timeout) and, on NCCL, creates each pair's
    communicator in an order that cannot deadlock, so the schedule's early receives never block on it. Hand-offs
    between a rank's own chunks use no channel.
    """
    rank, p2p = ctx.rank, channels.p2p
    pairs = set()
    for c in range(plan.num_stages - 1):
        for _, src, dst in cut_routes(plan, c):
            if src != dst:
                pairs.add((src, dst, "act"))
                pairs.add((dst, src, "grad"))
    mine = []
    for ch in sorted(pairs):
        if rank in ch[:2]:
            t = Transfer(ch[2], -1, -1, 0, ch[0], ch[1], 0, 1)
            buf = torch.zeros(1, device=ctx.device)
            if rank == ch[0]:
                p2p.send(t, buf)
            else:
                p2p.post_recv(t, buf)
                mine.append(t)
    for t in mine:
        p2p.wait_recv(t)
    p2p.finish()
    for g in channels.groups:
        waited(dist.all_reduce(torch.zeros(1, device=ctx.device), group=g.group, async_op=True), timeout,
               who, f"dapple.pipeline: reaching the ranks {g.ranks} of the {g.label} group",
               g.ranks)
