"""Mixed precision: autocast per stage, activations and their gradients on the wire in the autocast dtype, and fp16's
dynamic loss scaling with one decision per step for the whole job."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from ..core.plan import MIXED_PRECISIONS, REDUCE_DTYPES, Plan

MODES = dict(zip(MIXED_PRECISIONS, (torch.bfloat16, torch.float16)))  # a plan's names, their dtypes
REDUCE = dict(zip(REDUCE_DTYPES, (torch.bfloat16, torch.float16, torch.float32)))  # the same for reduce_dtype


def allreduce_dtype(plan: Plan, given: str | None) -> torch.dtype | None:
    """The dtype of the gradient AllReduce: ``given`` ("bf16", "fp16", "fp32"), or None for the plan's own
    ``reduce_dtype`` (None there: the gradients' own dtype); ValueError naming it otherwise."""
    name = plan.reduce_dtype if given is None else given
    if name is not None and name not in REDUCE:
        raise ValueError(f"reduce_dtype: expected one of {sorted(REDUCE)} or None (as the plan says), got {given!r}")
    return None if name is None else REDUCE[name]


@dataclass(frozen=True)
class Precision:
    """How a stage computes: ``dtype`` None is full precision (the model's own dtypes)."""

    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, mixed_precision: Any) -> "Precision":
        """From ``dapple.pipeline``'s ``mixed_precision``: "bf16", "fp16" or None; ValueError naming it otherwise."""
        if mixed_precision is None:
            return cls()
        if mixed_precision not in MODES:
            raise ValueError(f"mixed_precision: expected one of {sorted(MODES)} or None, got {mixed_precision!r}")
        return cls(MODES[mixed_precision])

    @property
    def name(self) -> str | None:
        return next((k for k, v in MODES.items() if v == self.dtype), None)

    def autocast(self, device: torch.device) -> ContextManager:
        """The context a stage's forward and the loss run in (parameters stay in their dtype, as under torch.amp)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def wire(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a boundary value of ``dtype`` travels in: floating values in the autocast dtype (half the bytes
        of fp32), others as they are."""
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype


class LossScaler:
    """fp16's dynamic loss scale, as ``torch.amp.GradScaler`` keeps it, for a whole pipelined job.

    ``train_step`` backpropagates the slice losses times :attr:`scale`, checks this rank's gradients for inf/NaN
    after their AllReduce, and adds the answer to the step's loss AllReduce: every rank learns at once whether any
    gradient anywhere overflowed. Gradients are unscaled before ``train_step`` returns, so clipping needs no
    ``unscale_``. A training loop stays as with GradScaler::

        loss = pipe.train_step(x, y)
        pipe.scaler.step(opt)      # opt.step(), unless some rank's gradients overflowed (then skipped everywhere)
        pipe.scaler.update()       # halve the scale after an overflow, double it after growth_interval good steps
        opt.zero_grad()

    Disabled (bf16 or full precision): ``step`` is ``opt.step()`` and ``update`` does nothing.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.found_inf = False  # the last step: some gradient anywhere was inf or NaN
        self._good_steps = 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` unless the last step's gradients overflowed on some rank; whether it stepped."""
        if self.enabled and self.found_inf:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """After each step: back off after an overflow, grow after ``growth_interval`` steps without one."""
        if not self.enabled:
            return
        if self.found_inf:
            self.scale *= self.backoff_factor
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (as ``torch.amp.GradScaler.state_dict``): the scale, the steps since it last
        changed, and the growth settings."""
        return {"scale": self.scale, "good_steps": self._good_steps, "enabled": self.enabled,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
        for k in ("growth_factor", "backoff_factor", "growth_interval"):
            if k in state:
                setattr(self, k, type(getattr(self, k))(state[k]))


def overflowed(params: Any) -> bool:
    """Whether any of ``params``' gradients holds an inf or NaN."""
    return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)


def unscale(params: Any, scale: float) -> None:
    """Divide ``params``' gradients by ``scale``."""
    if scale != 1.0 and math.isfinite(scale):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / scale)
