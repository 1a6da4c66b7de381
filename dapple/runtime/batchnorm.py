"""Deferred BatchNorm: running statistics of the whole global batch, once per step, equal on every replica."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose forward normalises each slice with the slice's own statistics (as BatchNorm does in
    training) but does not touch the running statistics; it sums what it saw instead, and :func:`commit`
    folds the sums of all micro-batches and all replicas of the stage into the running statistics once per
    step, as one BatchNorm forward over those rows (the global batch) would (torchgpipe's DeferredBatchNorm,
    plus the replicas). It shares the parameters and buffers of the BatchNorm it replaces (same tensors, same
    names), so the user's model, the optimizer and checkpoints see the same state."""

    # never None here (a BatchNorm that does not track running statistics is not deferred: defer_batch_norms)
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

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
        # per channel since the last commit: the count of values, and float64 sums of x and x^2
        self.sums: torch.Tensor | None = None  # (3, C): count, sum x, sum x^2

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # input: (N, C, *)
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        # BatchNorm's own kernel, with fresh running buffers and momentum 1: they come back holding the slice's
        # mean and unbiased variance, computed once, in the same pass that normalises
        mean, var = torch.zeros_like(self.running_mean), torch.ones_like(self.running_var)  # (C,) each
        out = F.batch_norm(input, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        n = input.numel() // input.shape[1]
        if self.sums is None:
            self.sums = torch.zeros(3, self.num_features, dtype=torch.float64, device=mean.device)
        count, sum_x, sum_x2 = self.sums  # (C,) views
        count += n
        mean = mean.double()
        sum_x.add_(mean, alpha=n)
        # out of place: the kernel's running buffers are saved for its backward (and .double() of a float64 is a no-op)
        sum_x2.add_((var.double() * ((n - 1) / n)).addcmul_(mean, mean), alpha=n)  # n (biased var + mean^2)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, deferred"


def _tracked(module: nn.Module) -> list[_BatchNorm]:
    """The BatchNorms of ``module`` that track running statistics (what :func:`defer_batch_norms` replaces)."""
    return [m for m in module.modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None]


def defer_batch_norms(module: nn.Module) -> list[DeferredBatchNorm]:
    """Replace every BatchNorm of ``module`` that tracks running statistics by a :class:`DeferredBatchNorm`
    sharing its tensors, in place, in ``module``'s hierarchy only (the user's model keeps its own modules);
    returns them in ``named_modules`` order, the same on every replica of the stage."""
    tracked, out = {id(m) for m in _tracked(module)}, []
    for name, m in list(module.named_modules()):
        if id(m) in tracked and not isinstance(m, DeferredBatchNorm):
            parent, _, leaf = name.rpartition(".")
            d = DeferredBatchNorm(m)
            setattr(module.get_submodule(parent) if parent else module, leaf, d)
            out.append(d)
    return out


def stats_size(module: nn.Module) -> int:
    """Length of a stage's statistics vector (:func:`gather_sums`): 3 numbers per channel of each BatchNorm."""
    return sum(3 * m.num_features for m in _tracked(module))


def stage_stats_sizes(model: nn.Module, stages: Sequence[nn.Module], deferred: bool) -> list[int]:
    """Per stage module, the length of its statistics vector (:func:`stats_size`; all 0 when not ``deferred``).

    ValueError when deferring the BatchNorms of a model whose stage modules hold none of them (torch.export
    inlines them into ATen ops).
    """
    sizes = [stats_size(m) if deferred else 0 for m in stages]
    if deferred and stats_size(model) and not sum(sizes):
        raise ValueError("deferred_batch_norm=True: the model's BatchNorm layers are not modules of the traced "
                         "graph (torch.export inlines them); use tracer='fx'")
    return sizes


@dataclass(frozen=True)
class StatsSlot:
    """A stage's deferred BatchNorms and their place in the vector of the step's loss AllReduce: the loss, then
    every stage's statistics in stage order (every rank knows all sizes, so every rank lays it out alike)."""

    layers: list[DeferredBatchNorm]  # this stage's, in named_modules order ([] when not deferred)
    slot: slice  # this stage's statistics within the vector
    length: int  # the vector's length: 1 + every stage's statistics size


def stats_slot(module: nn.Module, sizes: Sequence[int], stage: int, deferred: bool) -> StatsSlot:
    """Defer ``module``'s BatchNorms (when ``deferred``) and place stage ``stage``'s statistics (``sizes``: every
    stage's, from :func:`stage_stats_sizes`)."""
    layers = defer_batch_norms(module) if deferred else []
    return StatsSlot(layers, slice(1 + sum(sizes[:stage]), 1 + sum(sizes[:stage + 1])), 1 + sum(sizes))


def gather_sums(bns: list[DeferredBatchNorm], where: str) -> torch.Tensor:
    """This replica's sums of the step, every layer's (count, sum x, sum x^2) per channel, flat: (stats_size,).
    Summed over the stage's replicas (the engine adds them to the loss AllReduce), they go to :func:`commit`."""
    sums = [b.sums for b in bns]
    missing = [i for i, s in enumerate(sums) if s is None]
    if missing:
        raise RuntimeError(f"{where}: BatchNorm layers {missing} of this stage saw no rows this step")
    return torch.cat([s.reshape(-1) for s in sums if s is not None])


def commit(bns: list[DeferredBatchNorm], flat: torch.Tensor) -> None:
    """Fold the step's sums over all replicas (``flat``, laid out as :func:`gather_sums`) into the running
    statistics: BatchNorm's own update with the statistics of the whole global batch (the unbiased variance,
    ``momentum``, or the cumulative average when it is None)."""
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
