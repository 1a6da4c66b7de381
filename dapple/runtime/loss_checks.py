"""Mistakes in the user's loss a step detects: a sum over the rows instead of their mean, and a loss that does not
backpropagate (where single-device training raises)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

TOLERANCE = 1e-3  # relative: a mean of duplicated rows equals the mean (up to rounding); a sum doubles


def doubled(out: Any, rows: int) -> Any | None:
    """``out`` (a tensor or any pytree of them) with every tensor's ``rows`` rows repeated twice in dim 0; None when
    some tensor does not hold the rows in dim 0 (then duplicating rows says nothing)."""
    leaves, spec = pytree.tree_flatten(out)
    twice = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] != rows:
                return None
            x = torch.cat([x, x])
        twice.append(x)
    return pytree.tree_unflatten(twice, spec)


def sums_rows(loss_fn: Callable[..., torch.Tensor], out: Any, targets: Sequence[torch.Tensor],
              loss: torch.Tensor) -> bool:
    """Whether ``loss_fn`` sums over rows where it must average: its value on every row given twice is twice
    ``loss`` (a mean stays the same). False when it cannot tell (a zero loss, outputs without rows in dim 0)."""
    rows = targets[0].shape[0] if targets and targets[0].dim() else None
    value = float(loss.detach())
    if rows is None or not value or any(t.dim() == 0 or t.shape[0] != rows for t in targets):
        return False
    out2 = doubled(out, rows)
    if out2 is None:
        return False
    with torch.no_grad():
        twice = float(loss_fn(out2, *[torch.cat([t, t]) for t in targets]))
    return abs(twice - 2 * value) <= TOLERANCE * abs(value) < abs(twice - value)


def problems(flags: Sequence[float], where: str) -> str | None:
    """The message for the loss flags the ranks summed (:class:`StepRunner`'s), or None when there is none."""
    summed, no_grad = flags
    if summed:
        return (f"{where}: loss_fn returned the sum over the rows it was given, not their mean (its value on every row "
                f"given twice was twice its value): dapple scales each slice's loss by its share of the global "
                f"batch, so a sum would scale the loss and every gradient wrongly; return the mean (e.g. "
                f"reduction='mean'). This step's gradients were discarded")
    if no_grad:
        return (f"{where}: the loss does not require grad (element 0 of tensors does not require grad and does not "
                f"have a grad_fn, as loss.backward() raises on one device): was it computed from detached outputs or "
                f"under torch.no_grad()? This step's gradients were discarded")
    return None
