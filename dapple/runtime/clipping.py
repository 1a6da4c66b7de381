"""Gradient clipping by the global norm over every stage: a stage's replicas and tied copies counted once."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.dist import group_timeout
from ..core.plan import Plan
from .groups import GradGroup
from .roll import called
from .small_reduce import reduce_small

EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


def counted_parameters(plan: Plan, stage: int, rank: int, params: Sequence[nn.Parameter],
                       groups: Sequence[GradGroup]) -> list[nn.Parameter]:
    """This rank's parameters whose gradients enter the global norm.

    After a step every rank holding a parameter holds its whole gradient (a stage's replicas, and the stages sharing
    a tied parameter, sum theirs), so each parameter is counted once: on the lowest rank holding it.
    """
    holders = {id(p): g.ranks for g in groups for p in g.params}
    own = plan.stages[stage].devices  # a parameter in no group: this stage's replicas hold it (one, or untrained)
    return [p for p in params if rank == min(holders.get(id(p), own))]


def norm_group(world_size: int, backend: str, timeout: float, who: str, moment: str) -> dist.ProcessGroup:
    """The group of every rank that the norm's AllReduce runs on (every rank creates it at its first clipping).

    A group of its own: a rank that skips clipping then leaves the others waiting here, and itself waits in the
    next step's first collective, so both time out naming where the other is, instead of one clipping AllReduce
    meeting another rank's batch check on the default group (gloo aborts the process on such a mismatch).
    """
    return called(timeout, who, f"{moment}: creating the group of every rank", range(world_size), dist.new_group,
                  list(range(world_size)), timeout=group_timeout(timeout, backend))


def clip_grad_norm(counted: Sequence[nn.Parameter], params: Sequence[nn.Parameter], max_norm: float,
                   norm_type: float, *, device: torch.device, timeout: float, who: str, moment: str,
                   group: dist.ProcessGroup, error_if_nonfinite: bool = False) -> float:
    """Scale ``params``' gradients so that their global ``norm_type``-norm is at most ``max_norm``.

    Every rank must call it (one AllReduce over ``group``, every rank: :func:`norm_group`). ``counted`` are the
    parameters this rank adds to the norm (:func:`counted_parameters`); ``params`` all of its parameters, which
    are scaled. Errors begin "``who``, ``moment``". Returns the total norm before clipping, as
    ``torch.nn.utils.clip_grad_norm_`` does on one device.
    """
    where = f"{who}, {moment}"
    grads = [p.grad for p in counted if p.grad is not None]
    if math.isinf(norm_type):  # the largest entry anywhere
        local = max((float(g.detach().abs().max()) for g in grads if g.numel()), default=0.0)
        op = "max"
    else:  # sum of |g|^p over this rank's share, summed over ranks, then the p-th root
        local = sum(float(torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64)) ** norm_type
                    for g in grads)
        op = "sum"
    total = torch.tensor([local], dtype=torch.float64, device=device)
    reduce_small(total, op, timeout, who, f"{moment}: the gradient norm's AllReduce", range(dist.get_world_size()),
                 group)
    norm = float(total) if math.isinf(norm_type) else float(total) ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"{where}: the total norm of order {norm_type} of the gradients is {norm}, so they "
                           f"cannot be clipped (error_if_nonfinite=True)")
    scale = max_norm / (norm + EPS)
    if scale < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(scale)
    return norm
