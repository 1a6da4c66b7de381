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
    """Identity whose forward sleeps ``rows * ms_per_row`` and backward twice that, like a GPU kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ms_per_row: float) -> torch.Tensor:  # type: ignore[override]
        ctx.ms_per_row = ms_per_row
        hold(x.shape[0] * ms_per_row / 1e3)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hold(2 * grad.shape[0] * ctx.ms_per_row / 1e3)
        return grad.clone(), None


def emulate(x: torch.Tensor, ms_per_row: float) -> torch.Tensor:
    """Hold for ``rows * ms_per_row`` ms forward and twice that backward; an opaque call under torch.fx."""
    return _Sleep.apply(x, ms_per_row)


torch.fx.wrap("emulate")


class EmulatedLayer(nn.Module):
    """A small Linear whose forward takes ``ms_per_row`` ms per batch row (backward 2x), releasing the CPU.

    Stands in for a GPU layer on a CPU-only machine: time scales with the rows a rank holds, as on an
    accelerator, and processes sharing the machine do not compete for cores while "computing".
    """

    def __init__(self, width: int, ms_per_row: float):
        super().__init__()
        self.ms_per_row = float(ms_per_row)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        # emulate after the Linear: its output always requires grad, so the backward sleeps even in a first
        # layer whose input needs no gradient (a GPU still computes the weight gradient there)
        return torch.tanh(emulate(self.linear(x), self.ms_per_row))


class EmulatedNet(nn.Module):
    """``len(ms_per_row)`` emulated layers in a row, then a linear head: x (B, width) -> (B, classes)."""

    def __init__(self, ms_per_row: list[float], width: int = 16, num_classes: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([EmulatedLayer(width, ms) for ms in ms_per_row])
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
