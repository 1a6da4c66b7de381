"""Emulated-accelerator layers: hold the rank for a set time per row (sleeping, so the CPU is free)."""

from __future__ import annotations

import time

import torch
import torch.fx
from torch import nn

SPIN = 2e-4  # seconds of busy-wait at the end of a hold: a bare sleep wakes up 0.1-0.2 ms late, a kernel does not


def hold(seconds: float) -> None:
    """Hold the calling thread for ``seconds``: sleep (CPU free) until ``SPIN`` before the end, then busy-wait."""
    end = time.perf_counter() + seconds
    if seconds > SPIN:
        time.sleep(seconds - SPIN)
    while time.perf_counter() < end:
        pass


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``rows * ms_per_row`` and backward ``rows * backward_ms_per_row``, like a GPU
    kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ms_per_row: float, backward_ms_per_row: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_ms_per_row = backward_ms_per_row
        hold(x.shape[0] * ms_per_row / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hold(grad.shape[0] * ctx.backward_ms_per_row / 1e3)
        return grad.clone(), None, None


def emulate(x: torch.Tensor, ms_per_row: float, backward_ms_per_row: float | None = None,
            slowdown: torch.Tensor | None = None) -> torch.Tensor:
    """Hold for ``rows * ms_per_row`` ms forward and ``rows * backward_ms_per_row`` backward (default twice the
    forward's), both times ``slowdown`` (a one-element tensor read at each call; None: 1); an opaque call under
    torch.fx."""
    k = 1.0 if slowdown is None else float(slowdown)
    backward = 2 * ms_per_row if backward_ms_per_row is None else backward_ms_per_row
    return _Sleep.apply(x, ms_per_row * k, backward * k)


class _WeightWork(torch.autograd.Function):
    """Identity on a weight whose backward holds ``ms`` ms: the weight-gradient work of a layer, on the weight's
    own path of the graph (a split backward runs it in W, apart from the input gradients)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, ms: float) -> torch.Tensor:  # type: ignore[override]
        ctx.ms = ms
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hold(ctx.ms / 1e3)
        return grad, None


def weight_work(w: torch.Tensor, ms: float, slowdown: torch.Tensor | None = None) -> torch.Tensor:
    """``w``, with ``ms`` ms (times ``slowdown``, as :func:`emulate`) of work in the backward of its gradient; an
    opaque call under torch.fx."""
    return _WeightWork.apply(w, ms * (1.0 if slowdown is None else float(slowdown)))


torch.fx.wrap("emulate")
torch.fx.wrap("weight_work")


class EmulatedLayer(nn.Module):
    """A small Linear whose forward takes ``ms_per_row`` ms per batch row (backward 2x), releasing the CPU.

    Stands in for a GPU layer on a CPU-only machine: time scales with the rows a rank holds, as on an
    accelerator, and processes sharing the machine do not compete for cores while "computing". With
    ``weight_share`` > 0 that share of the backward is weight-gradient work, on the weight's own path of the
    graph (what a split backward defers), the rest input-gradient work.
    """

    slowdown: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, width: int, ms_per_row: float, weight_share: float = 0.0):
        super().__init__()
        if not 0.0 <= weight_share <= 1.0:
            raise ValueError(f"weight_share: expected a share in [0, 1], got {weight_share!r}")
        self.ms_per_row = float(ms_per_row)
        self.weight_share = float(weight_share)
        self.linear = nn.Linear(width, width)
        # a factor on every hold, read at run time (a traced graph bakes ms_per_row in): slow_down() sets it on
        # this process's copy; not part of the state_dict (a pipeline's stage holds it as the buffer
        # "<layer path>.slowdown", which a switch of plan moves with the layer)
        self.register_buffer("slowdown", torch.ones(()), persistent=False)

    def slow_down(self, factor: float) -> None:
        """Hold ``factor`` times the set time from now on, in this process (1.0: back to normal)."""
        if not factor > 0:
            raise ValueError(f"slow_down: expected a factor > 0, got {factor!r}")
        self.slowdown.fill_(float(factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        # emulate after the Linear: its output always requires grad, so the backward sleeps even in a first
        # layer whose input needs no gradient (a GPU still computes the weight gradient there)
        backward = 2 * self.ms_per_row
        if self.weight_share == 0.0:
            return torch.tanh(emulate(self.linear(x), self.ms_per_row, None, self.slowdown))
        w = weight_work(self.linear.weight, x.shape[0] * backward * self.weight_share, self.slowdown)
        h = nn.functional.linear(x, w, self.linear.bias)
        return torch.tanh(emulate(h, self.ms_per_row, backward * (1 - self.weight_share), self.slowdown))


class EmulatedNet(nn.Module):
    """``len(ms_per_row)`` emulated layers in a row, then a linear head: x (B, width) -> (B, classes)."""

    def __init__(self, ms_per_row: list[float], width: int = 16, num_classes: int = 4, weight_share: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList([EmulatedLayer(width, ms, weight_share) for ms in ms_per_row])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
