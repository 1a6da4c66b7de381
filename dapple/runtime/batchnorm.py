"""Deferred BatchNorm: running statistics of the whole global batch, once per step, equal on every replica."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._dist import bounded, group_timeout, wait_for


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose forward normalises each slice with the slice's own statistics (as BatchNorm does in
    training) but does not touch the running statistics; it sums what it saw instead, and :func:`commit`
    folds the sums of all micro-batches and all replicas of the stage into the running statistics once per
    step, as one BatchNorm forward over those rows (the global batch) would (torchgpipe's DeferredBatchNorm,
    plus the replicas). It shares the parameters and buffers of the BatchNorm it replaces (same tensors, same
    names), so the user's model, the optimizer and checkpoints see the same state."""

    def __init__(self, bn: _BatchNorm):
        nn.Module.__init__(self)  # not _BatchNorm.__init__: every tensor comes from ``bn``
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self._kind = type(bn)  # BatchNorm1d/2d/3d: its own input check
        self.weight, self.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(bn, name))
        self.training = bn.training
        self.reset_sums()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._kind._check_input_dim(self, input)

    def reset_sums(self) -> None:
        # float64 sums of x and x^2 per channel, and the count of values per channel, since the last commit
        self.sums: torch.Tensor | None = None  # (3, C): count, sum x, sum x^2

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # input: (N, C, *)
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        with torch.no_grad():
            x = input.detach().transpose(0, 1).reshape(input.shape[1], -1).double()  # (C, N * spatial)
            seen = torch.stack([torch.full_like(x[:, 0], x.shape[1]), x.sum(1), (x * x).sum(1)])  # (3, C)
            self.sums = seen if self.sums is None else self.sums + seen
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, deferred"


def defer_batch_norms(module: nn.Module) -> list[DeferredBatchNorm]:
    """Replace every BatchNorm of ``module`` that tracks running statistics by a :class:`DeferredBatchNorm`
    sharing its tensors, in place, in ``module``'s hierarchy only (the user's model keeps its own modules);
    returns them in ``named_modules`` order, the same on every replica of the stage."""
    out = []
    for name, m in list(module.named_modules()):
        if isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm) and m.track_running_stats \
                and m.running_mean is not None:
            parent, _, leaf = name.rpartition(".")
            d = DeferredBatchNorm(m)
            setattr(module.get_submodule(parent) if parent else module, leaf, d)
            out.append(d)
    return out


def count_batch_norms(module: nn.Module) -> int:
    """How many BatchNorms of ``module`` track running statistics (what :func:`defer_batch_norms` replaces)."""
    return sum(isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
               for m in module.modules())


def commit(bns: list[DeferredBatchNorm], group: Any, timeout: float, where: str) -> None:
    """Fold the step's sums into the running statistics: one AllReduce of every layer's sums over the stage's
    replicas (``group``; None: one replica), then BatchNorm's own update with the statistics of the whole
    global batch (the unbiased variance, ``momentum``, or the cumulative average when it is None)."""
    if not bns:
        return
    missing = [i for i, b in enumerate(bns) if b.sums is None]
    if missing:
        raise RuntimeError(f"{where}: BatchNorm layers {missing} of this stage saw no rows this step")
    flat = torch.cat([b.sums.reshape(-1) for b in bns])  # (sum over layers of 3 C,) float64
    if group is not None:
        wait_for(dist.all_reduce(flat, group=group, async_op=True), timeout,
                 f"{where}: BatchNorm statistics AllReduce over the stage's replicas")
    k = 0
    with torch.no_grad():
        for b in bns:
            n, s, q = flat[k:k + 3 * b.num_features].view(3, -1)  # (C,) each
            k += 3 * b.num_features
            mean = s / n
            var = (q - n * mean * mean) / (n - 1).clamp(min=1)  # unbiased, as BatchNorm's running_var
            b.num_batches_tracked.add_(1)
            m = 1.0 / float(b.num_batches_tracked) if b.momentum is None else b.momentum
            b.running_mean.mul_(1 - m).add_(mean.to(b.running_mean.dtype), alpha=m)
            b.running_var.mul_(1 - m).add_(var.to(b.running_var.dtype), alpha=m)
            b.reset_sums()


def replica_groups(plan: Any, stage_modules: list[nn.Module], rank: int, timeout: float, where: str) -> Any:
    """One process group per stage that has replicas and BatchNorms, created on every rank in stage order (as
    ``new_group`` needs); returns this rank's stage's, or None (one replica, or no BatchNorm)."""
    mine = None
    for s, m in enumerate(stage_modules):
        ranks = list(plan.stages[s].devices)
        if len(ranks) > 1 and count_batch_norms(m):
            g = bounded(timeout, f"{where}: creating the BatchNorm statistics group of stage {s} (ranks {ranks})",
                        dist.new_group, ranks, timeout=group_timeout(timeout, dist.get_backend()))
            if rank in ranks:
                mine = g
    return mine
