"""Example inputs and targets: validation with errors that name the value, and resizing along dim 0."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

import torch
from torch import Tensor

from ..core.checks import is_int

Batch = Union[Tensor, Sequence[Tensor], Mapping[str, Tensor]]  # one tensor, a tuple, or tensors by name (dim 0)


def as_tensors(value: Any, what: str) -> tuple[Tensor, ...]:
    """``value`` (a tensor or a non-empty tuple/list of tensors) as a tuple; TypeError naming ``what`` otherwise."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and len(value) > 0:
        for i, v in enumerate(value):
            if not isinstance(v, Tensor):
                raise TypeError(f"{what}[{i}]: expected a tensor (batch rows along dim 0), got {type(v).__name__} "
                                f"{v!r:.60}; fix Python-level arguments with concrete_args instead")
        return tuple(value)
    raise TypeError(f"{what}: expected a tensor or a non-empty tuple of tensors, got {type(value).__name__} "
                    f"{value!r:.60}")


def common_batch_size(named: dict[str, Tensor]) -> int:
    """The size of dim 0 shared by all ``named`` tensors; ValueError listing the shapes if they disagree."""
    for name, t in named.items():
        if t.dim() == 0:
            raise ValueError(f"{name}: expected a tensor with a batch dimension (dim 0), got a 0-d tensor")
    sizes = {t.shape[0] for t in named.values()}
    if len(sizes) != 1:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named.items())
        raise ValueError(f"inputs and targets must share the batch size along dim 0, got {shapes}")
    (b,) = sizes
    if b == 0:
        raise ValueError(f"example batch is empty (dim 0 has size 0): {', '.join(named)}")
    return int(b)


def check_batch_sizes(batch_sizes: Any, example: int) -> list[int]:
    """Sorted distinct positive batch sizes; None -> (example // 2, example) (just the example if it is 1)."""
    if batch_sizes is None:
        return sorted({max(1, example // 2), example})
    if isinstance(batch_sizes, int):
        batch_sizes = [batch_sizes]
    try:
        values = list(batch_sizes)
    except TypeError:
        raise TypeError(f"batch_sizes: expected a sequence of positive integers, got {batch_sizes!r}") from None
    if not values:
        raise ValueError("batch_sizes: expected at least one batch size, got an empty sequence")
    bad = [b for b in values if not is_int(b, 1)]
    if bad:
        raise ValueError(f"batch_sizes: expected positive integers, got {values} (bad: {bad})")
    return sorted(set(values))


def resize(t: Tensor, batch: int) -> Tensor:
    """``t`` with ``batch`` rows along dim 0: its first rows, or its rows repeated cyclically.

    (B, ...) -> (batch, ...)"""
    if batch == t.shape[0]:
        return t
    rows = torch.arange(batch, device=t.device) % t.shape[0]  # (batch,)
    return t.index_select(0, rows)


def to_model(t: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``t`` on ``device``; floating-point tensors also cast to the model's ``dtype``."""
    return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
